"""OpenAI-style error bodies for every response the gateway itself generates.

Clients written against OpenAI's API read ``error.message`` / ``error.type`` / ``error.code``;
the same shape is used for plain JSON responses and for the SSE ``event: error`` frame sent on
a stream that is already committed. Messages are fixed strings chosen here: they never echo
request data (which could carry a key) back to the client, with one exception, as OpenAI's own:
``model_not_found`` names the model the request asked for (:func:`model_not_found`), at most
``MAX_NAMED_MODEL`` characters of it, JSON-escaped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

__all__ = ["GatewayError", "error_body", "sse_error_frame", "backend_failure", "model_not_found", "ERRORS",
           "NO_RETRY", "MAX_NAMED_MODEL"]

# The longest model name an answer repeats: no table holds a longer one (gateway.modeltable's
# MAX_MODEL_NAME), so a longer "name" is some other text and is not echoed.
MAX_NAMED_MODEL = 256


@dataclass(frozen=True, slots=True)
class GatewayError:
    """One kind of gateway-generated failure: HTTP status, OpenAI error type/code, message."""

    status: int
    type: str
    code: str
    message: str


ERRORS: dict[str, GatewayError] = {
    "unauthorized": GatewayError(
        401, "invalid_request_error", "invalid_api_key", "Incorrect or missing API key."
    ),
    "not_found": GatewayError(404, "invalid_request_error", "not_found", "Unknown path."),
    "model_not_found": GatewayError(
        404, "invalid_request_error", "model_not_found", "The model does not exist or you do not have access to it."
    ),
    "uri_too_long": GatewayError(414, "invalid_request_error", "uri_too_long", "Request target too long."),
    "headers_too_large": GatewayError(
        431, "invalid_request_error", "headers_too_large", "Request headers too large or too many."
    ),
    "bad_request": GatewayError(400, "invalid_request_error", "bad_request", "Malformed request."),
    "invalid_multipart": GatewayError(
        400, "invalid_request_error", "invalid_multipart",
        "The request body is not multipart/form-data the gateway can read (its boundary, framing, or a "
        "model field given twice).",
    ),
    "model_too_long": GatewayError(
        400, "invalid_request_error", "model_too_long", "The model field is longer than any model name.",
    ),
    "invalid_json": GatewayError(
        400, "invalid_request_error", "invalid_json",
        "The request body is not a JSON object the gateway can accept (malformed, or nested too deeply).",
    ),
    "request_timeout": GatewayError(
        408, "invalid_request_error", "request_timeout", "The request was not received in time."
    ),
    "client_too_slow": GatewayError(
        408, "invalid_request_error", "client_too_slow",
        "The request body arrived more slowly than the gateway's minimum upload rate.",
    ),
    "upload_bytes_per_address": GatewayError(
        429, "rate_limit_error", "upload_bytes_per_address",
        "Too many request bytes are being uploaded from this address at once; finish or close other uploads.",
    ),
    "upload_bytes_full": GatewayError(
        429, "rate_limit_error", "upload_bytes_full",
        "The gateway is receiving too many request bytes at once; retry later.",
    ),
    "too_many_connections": GatewayError(
        429, "rate_limit_error", "too_many_connections",
        "Too many connections from this address; close idle connections or retry later.",
    ),
    "too_large": GatewayError(
        413, "invalid_request_error", "request_too_large", "Request body exceeds the gateway's limit."
    ),
    "queue_full": GatewayError(
        429, "rate_limit_error", "queue_full", "The gateway's admission queue is full; retry later."
    ),
    "queue_bytes_full": GatewayError(
        429, "rate_limit_error", "queue_full",
        "The gateway's admission queue is full (request bytes held while cold); retry later.",
    ),
    "cold_reject": GatewayError(
        503, "service_unavailable", "backend_activating",
        "The model backend is starting; retry after the indicated delay.",
    ),
    "draining": GatewayError(
        503, "service_unavailable", "gateway_draining", "The gateway is shutting down; retry the request."
    ),
    "backend_failure": GatewayError(
        502, "backend_error", "backend_failure", "The model backend failed while serving the request."
    ),
    "upstream_protocol_error": GatewayError(
        502, "backend_error", "upstream_protocol_error",
        "The model backend answered with a response the gateway cannot relay (not valid HTTP/1.1 framing).",
    ),
    "activation_timeout": GatewayError(
        504, "activation_timeout", "activation_timeout",
        "The model backend did not become ready before the activation timeout.",
    ),
}


# Answers where a client retry cannot help (the openai SDK retries 5xx unless told not to): an
# activation that timed out already waited the whole timeout. A draining gateway's 503 is retried:
# the request never reached a backend, the answer closes the connection, and by then (after
# drain_delay_seconds) the Pod is out of its Service, so the retry's new connection reaches another.
# A body cut for arriving below the minimum rate would be as slow again: the SDK retries a 408 unless
# told not to, and each retry re-uploads the whole body.
NO_RETRY = frozenset({"activation_timeout", "client_too_slow"})


def backend_failure(reason: str | None) -> str:
    """The answer's name for a backend that failed: its response refused as malformed (``reason``,
    one of ``gateway.wire.PROTOCOL_ERRORS``) or any other failure (a read failed, it closed)."""
    return "backend_failure" if reason is None else "upstream_protocol_error"


def model_not_found(model: str | None) -> GatewayError:
    """OpenAI's 404 for a model the caller may not use, in its words: "The model `X` does not exist
    or you do not have access to it." The same words whether the model does not exist or is not the
    caller's key's, so the answer tells nothing about which models exist. Without a usable name
    (none asked, or longer than any model name): the same message without it."""
    error = ERRORS["model_not_found"]
    if not model or len(model) > MAX_NAMED_MODEL:
        return error
    return dataclasses.replace(error, message=f"The model `{model}` does not exist or you do not have access to it.")


def error_body(error: GatewayError) -> bytes:
    """The JSON body ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(
        {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}},
        separators=(",", ":"),
    ).encode()


def sse_error_frame(error: GatewayError) -> bytes:
    """An SSE ``event: error`` frame; the openai client raises ``APIError`` with the message."""
    return b"event: error\ndata: " + error_body(error) + b"\n\n"
