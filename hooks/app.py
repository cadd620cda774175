"""The HTTP shell around the pure hook functions: parse, authenticate, dispatch, serialise.

No hook logic lives here. A hook handler takes the decoded request object and the server's
HookConfig and returns the response object; this module turns that into HTTP:

* malformed body (not JSON, not an object) or ``InvalidHookRequest`` → 400 JSON error;
* any other exception → 500 JSON error, logged with its traceback. Never a 200: Metacontroller
  deletes every child that a 200 response omits, so a half-built answer must not look like one;
* ``HookOverloaded`` → 429 with ``Retry-After`` (Metacontroller retries after that delay);
* a controller manifest of a newer release than this server (``hooks.compat``) → 503
  ``version_skew`` before any hook runs, logged once per controller;
* optional bearer token, matching Metacontroller's webhook ``authorization`` setting, which sends
  ``Authorization: <type, default Bearer> <Secret value, whitespace-trimmed>``;
* ETag (quoted sha256 of the exact body bytes) and ``If-None-Match`` → 304 without a body,
  which is what Metacontroller's ``webhook.etag`` cache expects.

Request bodies can carry Secret data (observed children), so they are never logged; the one
structured log line per request names the hook, the object, the status and the duration.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from hooks.compat import RefusalLog, check_controller, version_info
from hooks.errors import InvalidHookRequest
from hooks.metrics import POOL_SYNC_HOOK, HookMetrics
from scaler.secretfiles import read_secret_file

logger = logging.getLogger("noctaya.hooks")

TOKEN_FILE_ENV = "NOCTAYA_HOOK_TOKEN_FILE"
MAX_BODY_BYTES_ENV = "NOCTAYA_HOOK_MAX_BODY_BYTES"
# A sync request carries every observed child and related object of one LLMService (Deployments
# with their status, backend Pods, the KEDA CRD with its full schema). 32 MiB is far above any
# real request and still bounds what one call can make a worker buffer.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
JSON_CONTENT_TYPE = "application/json"

HookHandler = Callable[[dict[str, Any], Any], dict[str, Any]]


@dataclass(frozen=True)
class HookRoute:
    """One POST endpoint: its URL path, its metric/log name and the function that answers it."""

    path: str
    name: str
    module: str
    function: str


# The contract table of docs/architecture.md "Hook endpoints".
HOOK_ROUTES: tuple[HookRoute, ...] = (
    HookRoute("/v1/llmservice/customize", "llmservice_customize", "hooks.controller.customize", "customize"),
    HookRoute("/v1/llmservice/sync", "llmservice_sync", "hooks.controller.sync", "sync"),
    HookRoute("/v1/llmservice/finalize", "llmservice_finalize", "hooks.controller.finalize", "finalize"),
    HookRoute(
        "/v1/llmservice/autoscaling/customize",
        "autoscaling_customize",
        "hooks.controller.autoscaling",
        "customize",
    ),
    HookRoute("/v1/llmservice/autoscaling/sync", "autoscaling_sync", "hooks.controller.autoscaling", "sync"),
    HookRoute(
        "/v1/inferenceruntime/sync", "inferenceruntime_sync", "hooks.controller.runtime_status", "sync"
    ),
    HookRoute("/v1/acceleratorpool/customize", "acceleratorpool_customize", "hooks.controller.pool", "customize"),
    HookRoute("/v1/acceleratorpool/sync", "acceleratorpool_sync", "hooks.controller.pool", "sync"),
    HookRoute("/v1/llmgateway/customize", "llmgateway_customize", "hooks.controller.llmgateway", "customize"),
    HookRoute("/v1/llmgateway/sync", "llmgateway_sync", "hooks.controller.llmgateway", "sync"),
)
ROUTES_BY_PATH: dict[str, HookRoute] = {route.path: route for route in HOOK_ROUTES}


class HookOverloaded(Exception):
    """A handler asks Metacontroller to retry later (→ 429 with ``Retry-After``)."""

    def __init__(self, retry_after_seconds: int = 5, message: str = "hook server overloaded") -> None:
        super().__init__(message)
        self.retry_after_seconds = max(1, int(retry_after_seconds))


class _BadBody(Exception):
    """The body is not a JSON object; the message says why without quoting the body."""


def load_default_handlers() -> dict[str, HookHandler]:
    """Import the real hook functions. Done at app creation so a missing module fails startup."""
    handlers: dict[str, HookHandler] = {}
    for route in HOOK_ROUTES:
        module = importlib.import_module(route.module)
        handlers[route.path] = getattr(module, route.function)
    return handlers


class ExpectedToken:
    """The bearer token Metacontroller must send. From a file, it is reread on every hook call, so a
    rotated Secret (the kubelet swaps the mounted file) takes effect without a restart; a file that
    is briefly missing or empty keeps the last good token rather than refusing every call."""

    def __init__(self, token: bytes, path: str | None = None) -> None:
        self._token = token
        self._path = path

    def current(self) -> bytes:
        if self._path is not None:
            fresh = read_secret_file(self._path)
            if fresh is not None:
                self._token = fresh
        return self._token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The expected token, trimmed like Metacontroller trims the Secret value it sends."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        # An empty file would otherwise mean "accept `Bearer `" — refuse to start instead.
        raise ValueError(f"hook token file {path} is empty")
    return token


def _max_body_bytes_from_env() -> int:
    raw = os.environ.get(MAX_BODY_BYTES_ENV, "")
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    value = int(raw)
    if value <= 0:
        raise ValueError(f"{MAX_BODY_BYTES_ENV} must be a positive integer, got {raw!r}")
    return value


def serialize_body(result: Mapping[str, Any]) -> bytes:
    """Compact JSON in the handler's key order; the same response always yields the same bytes.

    Keys are not sorted: the handlers are deterministic, so their order is already stable, and
    keeping it keeps the output readable (apiVersion, kind, metadata first). NaN/Infinity are
    refused because they are not JSON and Metacontroller's decoder would reject the response.
    """
    return json.dumps(result, separators=(",", ":"), allow_nan=False).encode("utf-8")


def etag_for(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest() + '"'


def error_response(
    status: int, error_type: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    body = serialize_body({"error": {"message": message, "type": error_type}})
    response = Response(body, status=status, content_type=JSON_CONTENT_TYPE)
    for key, value in (headers or {}).items():
        response.headers[key] = value
    return response


def _parse_body() -> dict[str, Any]:
    raw = request.get_data(cache=False)
    if not raw:
        raise _BadBody("request body is empty; expected a JSON object")
    try:
        decoded = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise _BadBody("request body is not UTF-8 JSON") from exc
    except json.JSONDecodeError as exc:
        raise _BadBody(f"request body is not valid JSON (line {exc.lineno}, column {exc.colno})") from exc
    except RecursionError as exc:
        raise _BadBody("request body is nested too deeply") from exc
    if not isinstance(decoded, dict):
        raise _BadBody(f"request body must be a JSON object, got {type(decoded).__name__}")
    return decoded


def _object_key(hook_request: Mapping[str, Any]) -> str | None:
    """`namespace/name` of the parent (or decorated object), for the log line only."""
    root = hook_request.get("parent")
    if root is None:
        root = hook_request.get("object")
    if not isinstance(root, Mapping):
        return None
    metadata = root.get("metadata")
    if not isinstance(metadata, Mapping):
        return None
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not isinstance(name, str):
        return None
    return f"{namespace}/{name}" if isinstance(namespace, str) and namespace else name


def _object_version(hook_request: Mapping[str, Any]) -> str | None:
    """The resourceVersion the hook's answer was computed from (Metacontroller sends its cached copy,
    which can lag the last write), for the log line only."""
    root = hook_request.get("parent")
    if root is None:
        root = hook_request.get("object")
    metadata = root.get("metadata") if isinstance(root, Mapping) else None
    version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    return version if isinstance(version, str) else None


def _bearer_token(header_value: str | None) -> str | None:
    if not header_value:
        return None
    scheme, _, credentials = header_value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip()


def create_app(
    handlers: Mapping[str, HookHandler] | None = None,
    config: Any = None,
    token: str | None = None,
    *,
    max_body_bytes: int | None = None,
    metrics: HookMetrics | None = None,
) -> Flask:
    """Build the hook server.

    ``handlers`` maps a path of :data:`HOOK_ROUTES` to its function; when omitted the real hook
    functions are imported and ``config`` defaults to ``HookConfig.from_env()``. ``token`` (or the
    file named by ``NOCTAYA_HOOK_TOKEN_FILE``, read once here) turns on bearer authentication of
    the hook routes; ``/healthz``, ``/version`` and ``/metrics`` stay open for kubelet probes,
    people and Prometheus.
    """
    handlers, config = _resolve_handlers(handlers, config)
    expected = _expected_token(token)
    if max_body_bytes is None:
        max_body_bytes = _max_body_bytes_from_env()

    app = Flask("noctaya-hooks")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    hook_metrics = metrics if metrics is not None else HookMetrics()
    routes = [ROUTES_BY_PATH[path] for path in handlers]
    hook_metrics.prime(route.name for route in routes)
    app.extensions["noctaya_hook_metrics"] = hook_metrics
    _authenticate_and_observe(app, expected, {route.name for route in routes}, hook_metrics)
    refusals = RefusalLog()
    for route in routes:
        view = HookView(route, handlers[route.path], config, hook_metrics, refusals, max_body_bytes)
        app.add_url_rule(route.path, endpoint=route.name, view_func=view, methods=["POST"])
    _open_routes(app, config, hook_metrics)
    _error_handlers(app)
    return app


def _resolve_handlers(handlers: Mapping[str, HookHandler] | None, config: Any) -> tuple[Mapping[str, HookHandler], Any]:
    """The real hook functions and ``HookConfig.from_env()`` unless given; unknown paths refused."""
    if handlers is None:
        handlers = load_default_handlers()
        if config is None:
            from hooks.config import HookConfig  # lazy: the shell is importable without the hooks

            config = HookConfig.from_env()
    unknown = sorted(set(handlers) - set(ROUTES_BY_PATH))
    if unknown:
        raise ValueError(f"no hook route for path(s) {unknown}; known: {sorted(ROUTES_BY_PATH)}")
    return handlers, config


def _expected_token(token: str | None) -> ExpectedToken | None:
    """The token given, or the one in NOCTAYA_HOOK_TOKEN_FILE (reread on each call), or none."""
    token_file = os.environ.get(TOKEN_FILE_ENV) if token is None else None
    if token_file:
        token = read_token_file(token_file)  # fails at start on a missing or empty file
    if token is None:
        return None
    if not token.strip():
        raise ValueError("hook token must not be empty")
    return ExpectedToken(token.strip().encode("utf-8"), token_file)


def _authenticate_and_observe(app: Flask, expected: ExpectedToken | None, hooks: set[str],
                              hook_metrics: HookMetrics) -> None:
    """Bearer authentication of the hook routes before they run; a metric and one log line after."""

    @app.before_request
    def _start_and_authenticate() -> Response | None:
        g.started = time.perf_counter()
        if expected is None or request.endpoint not in hooks:
            return None
        presented = _bearer_token(request.headers.get("Authorization"))
        if presented is None or not hmac.compare_digest(presented.encode("utf-8"), expected.current()):
            return error_response(
                401,
                "unauthorized",
                "missing or invalid bearer token",
                {"WWW-Authenticate": 'Bearer realm="noctaya-hooks"'},
            )
        return None

    @app.after_request
    def _observe(response: Response) -> Response:
        hook = request.endpoint or ""
        if hook not in hooks:
            return response
        seconds = time.perf_counter() - g.get("started", time.perf_counter())
        hook_metrics.observe(hook, seconds, response.status_code, g.get("error_kind"))
        logger.info(
            json.dumps(
                {
                    "event": "hook",
                    "hook": hook,
                    "object": g.get("hook_object"),
                    "resourceVersion": g.get("hook_object_version"),
                    "status": response.status_code,
                    "durationMs": round(seconds * 1000.0, 3),
                },
                separators=(",", ":"),
            )
        )
        return response


class HookView:
    """One hook route's view: parse, refuse a newer controller, run the handler, serialise with an
    ETag; every failure an error response of its own status (never a 200 with a half-built answer)."""

    def __init__(self, route: HookRoute, handler: HookHandler, config: Any, hook_metrics: HookMetrics,
                 refusals: RefusalLog, max_body_bytes: int) -> None:
        self.route, self.handler, self.config = route, handler, config
        self.hook_metrics, self.refusals, self.max_body_bytes = hook_metrics, refusals, max_body_bytes
        self.__name__ = route.name  # Flask names the view after it

    def __call__(self) -> Response:
        try:
            return self._answer()
        except (_BadBody, InvalidHookRequest) as exc:
            return error_response(400, "bad_request", str(exc))
        except RequestEntityTooLarge:
            return error_response(413, "payload_too_large", f"request body exceeds {self.max_body_bytes} bytes")
        except HookOverloaded as exc:
            return error_response(429, "overloaded", str(exc), {"Retry-After": str(exc.retry_after_seconds)})
        except Exception:
            # The traceback goes to the log; the response names only the hook, because an
            # exception message can quote request data.
            logger.exception("hook %s failed for %s", self.route.name, g.get("hook_object"))
            return error_response(500, "internal", f"internal error in hook {self.route.name}; see hook server log")

    def _answer(self) -> Response:
        hook_request = _parse_body()
        g.hook_object = _object_key(hook_request)
        g.hook_object_version = _object_version(hook_request)
        refusal = check_controller(hook_request)
        if refusal is not None:
            self.refusals.report(refusal)
            g.error_kind = refusal.kind
            return error_response(refusal.status, refusal.kind, refusal.message)
        result = self.handler(hook_request, self.config)
        if not isinstance(result, Mapping):
            raise TypeError(f"hook {self.route.name} returned {type(result).__name__}, not an object")
        body = serialize_body(result)
        if self.route.name == POOL_SYNC_HOOK:
            self.hook_metrics.observe_pool_sync(hook_request, result)
        return _with_etag(body)


def _with_etag(body: bytes) -> Response:
    """200 with the body's ETag, or 304 without a body when the caller already has it."""
    etag = etag_for(body)
    if request.if_none_match.contains_weak(etag.strip('"')):
        not_modified = Response(status=304)
        not_modified.headers["ETag"] = etag
        return not_modified
    response = Response(body, status=200, content_type=JSON_CONTENT_TYPE)
    response.headers["ETag"] = etag
    return response


def _open_routes(app: Flask, config: Any, hook_metrics: HookMetrics) -> None:
    """/healthz, /version and /metrics: never authenticated (kubelet probes, people, Prometheus)."""

    @app.get("/healthz")
    def healthz() -> Response:
        return Response(serialize_body({"status": "ok"}), status=200, content_type=JSON_CONTENT_TYPE)

    @app.get("/version")
    def version() -> Response:
        return Response(serialize_body(version_info(config)), status=200, content_type=JSON_CONTENT_TYPE)

    @app.get("/metrics")
    def metrics_view() -> Response:
        body, content_type = hook_metrics.exposition()
        return Response(body, status=200, content_type=content_type)


def _error_handlers(app: Flask) -> None:
    """Errors raised outside a hook's own view, in the hooks' JSON error shape."""

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        # 404/405/413 raised by routing or Werkzeug itself: same JSON shape as the hook errors.
        status = exc.code or 500
        error_type = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            status, "http_error"
        )
        headers = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None
        return error_response(status, error_type, exc.description or exc.name, headers)

    @app.errorhandler(Exception)
    def unexpected_error(exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.path)
        return error_response(500, "internal", "internal error; see hook server log")
