"""Gateway configuration: environment variables (as rendered into the gateway Deployment), each
overridable by a ``--kebab-case`` flag, validated once at start-up.

The contract (names, defaults) is the table in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GatewayConfig", "ConfigError", "load_config", "build_parser", "parse_field"]


# Open public connections one client address may hold per worker, by default. Small: a client's
# concurrency rarely needs more (browsers use 6, SDK pools reuse a few), and 64 addresses' requests in
# progress are needed to fill the default pool of 4096. An address at its cap has its own oldest idle
# connection closed before a new one is refused.
DEFAULT_CONNECTIONS_PER_ADDRESS = 64


class ConfigError(ValueError):
    """Invalid or missing configuration; the message names the variable."""


@dataclass(frozen=True)
class GatewayConfig:
    backend_url: str
    served_model_name: str
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    admin_port: int = 9092
    readiness_path: str = "/health"
    max_queue: int = 100
    cold_mode: str = "keepalive"
    activation_timeout_seconds: float = 300.0
    ready_grace_seconds: float = 15.0
    queue_full_retry_after_seconds: int = 5
    retry_after_seconds: int = 10
    heartbeat_seconds: float = 10.0
    drain_grace_seconds: float = 30.0
    # After SIGTERM, new requests are still served this long (inside the grace) while readiness says
    # 503: Kubernetes takes a terminating Pod out of its Service's endpoints at once, but every
    # kube-proxy (and any client-side balancer) learns it a moment later, and until then sends new
    # connections here. Refusing them at once fails requests a rollout should never fail.
    drain_delay_seconds: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    auth_key_file: str | None = None
    # A shared gateway's model with several keys (``authKeyFiles`` in the model table, not an env
    # variable): any of them opens the model. Set, it replaces auth_key_file.
    auth_key_files: tuple[str, ...] = ()
    scaler_mode: str = "local"
    scaler_port: int = 9090
    scaling_target: int = 10
    metric_name: str = "noctaya-demand"
    aggregator_url: str | None = None
    aggregator_token_file: str | None = None
    aggregator_previous_token_file: str | None = None
    aggregator_ca_file: str | None = None
    scaler_tls_cert_file: str | None = None
    scaler_tls_key_file: str | None = None
    scaler_tls_ca_file: str | None = None
    backend_accelerators: int = 0
    # Extensions (documented in docs/architecture.md; defaults suit production).
    probe_interval_seconds: float = 0.1
    probe_timeout_seconds: float = 1.0
    upstream_connect_timeout_seconds: float = 3.0
    upstream_idle_timeout_seconds: float = 600.0
    client_idle_timeout_seconds: float = 120.0
    # A fresh connection's first byte (of its first request) must come within this (and within the
    # idle timeout): clients connect to send at once, so one that sends nothing only holds a slot.
    # Keep-alive connections between requests keep the idle timeout.
    client_first_byte_timeout_seconds: float = 10.0
    # One request's head, from its first byte: a slowloris does not hold its connection longer.
    client_request_timeout_seconds: float = 60.0
    # The body is cut by its progress, not by a fixed total (gateway.server.UploadPace): a steady
    # client on a slow uplink (4 MiB at 60 KB/s) is never cut; one below the minimum rate is, with a
    # 408 that tells the SDK not to retry (a retry would be as slow). 8 KiB/s over 10 s, after 10 s
    # for the first bytes; the cap bounds any body (8 MiB at the minimum rate is ~17 minutes).
    client_min_rate_bytes: int = 8 * 1024
    client_min_rate_window_seconds: float = 10.0
    client_body_grace_seconds: float = 10.0
    client_body_timeout_seconds: float = 1800.0
    max_connections: int = 4096
    # None = DEFAULT_CONNECTIONS_PER_ADDRESS, at most an eighth of max_connections; 0 = no cap (every
    # client behind one ingress, proxy or SNAT address). Idle connections never lock anyone out
    # whatever this is (a full pool evicts the oldest idle one, gateway.idle): the cap bounds what one
    # address's requests in progress take of the pool.
    max_connections_per_address: int | None = None
    # The control ports (admin, and the in-process scaler's): kubelet probes come from the node's
    # address and Prometheus from its own, so a few connections per address is all they use, and one
    # address holding more can never take the admin port's pool (64) or the scaler's from them.
    control_connections_per_address: int = 8
    # An admin connection waits this long for a request head to start (and the head this long to
    # complete), from its accept and between requests: idle sockets cannot keep the pool.
    admin_idle_timeout_seconds: float = 5.0
    max_held_body_bytes: int = 256 * 1024 * 1024
    # Bodies still arriving (gateway.state.uploads), per worker, apart from the held budget. None:
    # the held budget (all uploads) and twice the largest body (one address).
    max_upload_bytes: int | None = None
    max_upload_bytes_per_address: int | None = None
    # A shared gateway: the share of the held budget one model's held bodies may take, so one cold
    # model cannot refuse another's requests (at least one largest body). A half: with the smallest
    # derived budget (64 MiB under a 256 MiB limit) one model still holds four 8 MiB bodies.
    held_body_share_per_model: float = 0.5
    log_level: str = "info"
    gateway_workers: int | None = None  # None = the container's CPU limit (gateway.workers.default_workers)
    # A shared gateway: the models come from this file (gateway.modeltable), and backend_url /
    # served_model_name are not used.
    model_table_file: str | None = None
    # Where the backend's Pods come from (gateway.backends): ``service``, the backend URL's address
    # only (kube-proxy picks a Pod per connection); ``endpointslices``, a watch of the backend
    # Service's EndpointSlices with the Pod's service account, balancing per Pod.
    endpoint_source: str = "service"
    service_account_dir: str = "/var/run/secrets/kubernetes.io/serviceaccount"
    # Balancing over Pods (gateway.balance): prefix affinity with bounded load, and the cold batch.
    prefix_affinity: bool = True
    affinity_prefix_bytes: int = 256
    affinity_load_factor: float = 1.25
    pod_batch: int = 8
    # Behind a Service address: a pooled connection's life, so kube-proxy's per-connection choice
    # reaches new Pods within this (0 = connections live as long as they are reused).
    upstream_max_connection_age_seconds: float = 5.0

    @property
    def connections_per_address(self) -> int:
        """The per-address cap in force (0 = none)."""
        if self.max_connections_per_address is None:
            return max(1, min(DEFAULT_CONNECTIONS_PER_ADDRESS, self.max_connections // 8))
        return self.max_connections_per_address

    @property
    def upload_bytes(self) -> int:
        """The worker's bound on body bytes still arriving."""
        return self.max_held_body_bytes if self.max_upload_bytes is None else self.max_upload_bytes

    @property
    def upload_bytes_per_address(self) -> int:
        """One client address's bound on body bytes still arriving, per worker (0 = none)."""
        if self.max_upload_bytes_per_address is None:
            return 2 * self.max_body_bytes
        return self.max_upload_bytes_per_address

    @property
    def held_bytes_per_model(self) -> int:
        """A shared gateway's bound on one model's held bodies."""
        return max(self.max_body_bytes, int(self.max_held_body_bytes * self.held_body_share_per_model))

    @property
    def key_files(self) -> tuple[str, ...]:
        """The API key files a request may match (none: no key needed)."""
        if self.auth_key_files:
            return self.auth_key_files
        return (self.auth_key_file,) if self.auth_key_file else ()

    @property
    def backend_host(self) -> str:
        return urllib.parse.urlsplit(self.backend_url).hostname or ""

    @property
    def backend_port(self) -> int:
        return urllib.parse.urlsplit(self.backend_url).port or 80

    @property
    def backend_netloc(self) -> str:
        return urllib.parse.urlsplit(self.backend_url).netloc

    @property
    def backend_base_path(self) -> str:
        """Path prefix of the backend URL (usually empty), without a trailing slash."""
        return urllib.parse.urlsplit(self.backend_url).path.rstrip("/")


def _pos_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise ValueError("must be >= 1")
    return n


def _port(v: str) -> int:
    n = int(v)
    if not 0 <= n <= 65535:  # 0 = ephemeral (tests)
        raise ValueError("must be a TCP port")
    return n


def _pos_float(v: str) -> float:
    x = float(v)
    if not x > 0 or x != x or x == float("inf"):
        raise ValueError("must be a finite number > 0")
    return x


def _share(v: str) -> float:
    x = float(v)
    if not 0 < x <= 1:
        raise ValueError("must be a number in (0, 1]")
    return x


def _nonneg_float(v: str) -> float:
    x = float(v)
    if not x >= 0 or x == float("inf"):
        raise ValueError("must be a finite number >= 0")
    return x


def _nonneg_int(v: str) -> int:
    n = int(v)
    if n < 0:
        raise ValueError("must be >= 0")
    return n


def _choice(*options: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        v = v.strip().lower()
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return v

    return parse


def _text(v: str) -> str:
    v = v.strip()
    if not v:
        raise ValueError("must not be empty")
    return v


def _path(v: str) -> str:
    v = v.strip()
    if not v.startswith("/") or any(c in v for c in " \r\n\t"):
        raise ValueError("must be an absolute URL path")
    return v


def _backend_url(v: str) -> str:
    v = v.strip().rstrip("/")
    parts = urllib.parse.urlsplit(v)
    if parts.scheme != "http":
        raise ValueError("must be an http:// URL (in-cluster Service)")
    if not parts.hostname:
        raise ValueError("must name a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("must not carry a query, fragment or credentials")
    parts.port  # noqa: B018 - raises ValueError for a bad port
    return v


def _boolean(v: str) -> bool:
    v = v.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ValueError("must be true or false")


def _load_factor(v: str) -> float:
    x = _pos_float(v)
    if x < 1:
        raise ValueError("must be >= 1 (1: every Pod at most the mean load, rounded up)")
    return x


def _probe_interval(v: str) -> float:
    x = _pos_float(v)
    if x > 0.2:
        raise ValueError("must be <= 0.2 seconds (SPEC: probe every <= 200 ms while waiting)")
    return x


# field -> parser; the env name is NOCTAYA_ + field upper-cased, the flag --field-with-dashes.
_PARSERS: dict[str, Callable[[str], Any]] = {
    "backend_url": _backend_url,
    "served_model_name": _text,
    "listen_host": _text,
    "listen_port": _port,
    "admin_port": _port,
    "readiness_path": _path,
    "max_queue": _pos_int,
    "cold_mode": _choice("keepalive", "reject"),
    "activation_timeout_seconds": _pos_float,
    "ready_grace_seconds": _nonneg_float,
    "queue_full_retry_after_seconds": _nonneg_int,
    "retry_after_seconds": _nonneg_int,
    "heartbeat_seconds": _pos_float,
    "drain_grace_seconds": _nonneg_float,
    "drain_delay_seconds": _nonneg_float,
    "max_body_bytes": _pos_int,
    "auth_key_file": _text,
    "scaler_mode": _choice("local", "report", "off"),
    "scaler_port": _port,
    "scaling_target": _pos_int,
    "metric_name": _text,
    "aggregator_url": _text,
    "aggregator_token_file": _text,
    "aggregator_previous_token_file": _text,
    "aggregator_ca_file": _text,
    "scaler_tls_cert_file": _text,
    "scaler_tls_key_file": _text,
    "scaler_tls_ca_file": _text,
    "backend_accelerators": _nonneg_int,
    "probe_interval_seconds": _probe_interval,
    "probe_timeout_seconds": _pos_float,
    "upstream_connect_timeout_seconds": _pos_float,
    "upstream_idle_timeout_seconds": _pos_float,
    "client_idle_timeout_seconds": _pos_float,
    "client_first_byte_timeout_seconds": _pos_float,
    "client_request_timeout_seconds": _pos_float,
    "client_min_rate_bytes": _nonneg_int,
    "client_min_rate_window_seconds": _pos_float,
    "client_body_grace_seconds": _nonneg_float,
    "client_body_timeout_seconds": _pos_float,
    "max_connections": _pos_int,
    "max_connections_per_address": _nonneg_int,
    "control_connections_per_address": _nonneg_int,
    "admin_idle_timeout_seconds": _pos_float,
    "max_held_body_bytes": _pos_int,
    "max_upload_bytes": _pos_int,
    "max_upload_bytes_per_address": _nonneg_int,
    "held_body_share_per_model": _share,
    "log_level": _choice("debug", "info", "warning", "error"),
    "gateway_workers": _pos_int,
    "model_table_file": _text,
    "endpoint_source": _choice("service", "endpointslices"),
    "service_account_dir": _text,
    "prefix_affinity": _boolean,
    "affinity_prefix_bytes": _pos_int,
    "affinity_load_factor": _load_factor,
    "pod_batch": _pos_int,
    "upstream_max_connection_age_seconds": _nonneg_float,
}

_HELP = {
    "backend_url": "backend Service URL, e.g. http://qwen-backend.models.svc:8000 (required)",
    "served_model_name": "model id answered by GET /v1/models while cold (required)",
    "max_queue": "bound on waiting + in-flight requests",
    "cold_mode": "keepalive (hold with SSE heartbeats) or reject (503 + Retry-After)",
    "admin_port": "port of /metrics and /noctaya/queue (and /healthz); the public port serves only /v1 and /healthz",
    "auth_key_file": "client API key file (mounted Secret key), reread per request; unset = no auth",
    "scaler_mode": "local (gRPC scaler in a child process), report (push to aggregator), off",
    "aggregator_ca_file": "CA that verifies the aggregator's certificate (its URL must then be https://)",
    "backend_accelerators": "accelerators one backend replica requests; exported for accelerator-hours",
    "client_request_timeout_seconds": "deadline for one request's head, from its first byte (408 beyond)",
    "client_min_rate_bytes": "slowest body upload accepted, bytes/s over each window (408, x-should-retry: false, "
                             "below); 0 = only the body cap",
    "client_min_rate_window_seconds": "window over which a body upload must keep the minimum rate",
    "client_body_grace_seconds": "time allowed for a body's first bytes before the minimum rate applies",
    "client_body_timeout_seconds": "cap on one body's upload whatever its rate (408 beyond)",
    "max_upload_bytes": "body bytes still arriving, all clients, per worker (429 upload_bytes_full beyond); "
                        "default: the held-body budget",
    "max_upload_bytes_per_address": "body bytes still arriving from one client address, per worker "
                                    "(429 upload_bytes_per_address beyond); default: 2 x max body; 0 = no bound",
    "held_body_share_per_model": "shared gateway: share (0-1] of the held-body budget one model may hold",
    "max_connections_per_address": "open public connections one client address may hold per worker (beyond it its "
                                   "oldest idle one is closed, else 429); default: 64, at most an eighth of max "
                                   "connections; 0 = no cap (set it behind an ingress, proxy, mesh or SNAT)",
    "client_first_byte_timeout_seconds": "a new connection that sends no byte within this is closed (at most "
                                         "the idle timeout)",
    "control_connections_per_address": "open connections one client address may hold on the admin port and on the "
                                       "in-process scaler port, per worker (closed beyond); 0 = no cap",
    "admin_idle_timeout_seconds": "time an admin-port connection may wait before a request head starts, and a head "
                                  "to complete (closed beyond)",
    "gateway_workers": "worker processes sharing the port (SO_REUSEPORT); default: the container's CPU limit, >= 1",
    "endpoint_source": "service (the backend URL's address) or endpointslices (watch the backend Service's Pods "
                       "and balance over them; needs a service account that may list and watch EndpointSlices)",
    "prefix_affinity": "true: requests with a prompt_cache_key or a common prompt beginning go to one Pod "
                       "(bounded load); false: fewest outstanding requests",
    "pod_batch": "held requests one Pod takes while other Pods of the model are still starting",
    "upstream_max_connection_age_seconds": "behind a Service address, a pooled backend connection's life "
                                           "(0 = unbounded)",
}


def parse_field(field: str, raw: str) -> Any:
    """One setting from its text, by the rules of its environment variable (ValueError if bad)."""
    return _PARSERS[field](raw)


def env_name(field: str) -> str:
    return "NOCTAYA_" + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="Noctaya gateway: OpenAI-compatible front door with bounded cold admission.",
        epilog="Every flag falls back to the NOCTAYA_* environment variable of the same name.",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    for field in _PARSERS:
        default = defaults.get(field, dataclasses.MISSING)
        shown = "required" if default is dataclasses.MISSING else f"default: {default}"
        help_text = _HELP.get(field, field.replace("_", " "))
        parser.add_argument(
            flag_name(field), dest=field, default=None, metavar="VALUE",
            help=f"{help_text} [{env_name(field)}; {shown}]",
        )
    return parser


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Flags win over env, env over defaults. Raises ConfigError naming the bad variable."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(list(argv) if argv is not None else [])
    values: dict[str, Any] = {}
    for field, parse in _PARSERS.items():
        raw = getattr(args, field)
        source = flag_name(field)
        if raw is None:
            raw = environ.get(env_name(field))
            source = env_name(field)
        if raw is None or (raw.strip() == "" and field not in ("backend_url", "served_model_name")):
            continue
        try:
            values[field] = parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if "model_table_file" in values:  # a shared gateway: each model names its own
        values.setdefault("backend_url", "http://model-table.invalid")
        values.setdefault("served_model_name", "(model table)")
    for required in ("backend_url", "served_model_name"):
        if required not in values:
            raise ConfigError(f"{env_name(required)} (or {flag_name(required)}) is required")
    if "max_held_body_bytes" not in values:
        # From the container's memory limit: held bodies alone must never OOM-kill the gateway.
        from gateway.cgroup import cgroup_root, held_body_budget

        max_body = values.get("max_body_bytes", GatewayConfig.max_body_bytes)
        values["max_held_body_bytes"] = held_body_budget(max_body, environ.get("NOCTAYA_CGROUP_ROOT") or cgroup_root())
    config = GatewayConfig(**values)
    if config.scaler_mode == "report" and not (config.aggregator_url and config.aggregator_token_file):
        raise ConfigError(
            "NOCTAYA_SCALER_MODE=report needs NOCTAYA_AGGREGATOR_URL and NOCTAYA_AGGREGATOR_TOKEN_FILE"
        )
    if config.aggregator_ca_file and not (config.aggregator_url or "").lower().startswith("https://"):
        raise ConfigError("NOCTAYA_AGGREGATOR_CA_FILE is set but NOCTAYA_AGGREGATOR_URL is not https://")
    if config.max_held_body_bytes < config.max_body_bytes:
        raise ConfigError("NOCTAYA_MAX_HELD_BODY_BYTES must be >= NOCTAYA_MAX_BODY_BYTES")
    _check_upload_bounds(config)
    tls = (config.scaler_tls_cert_file, config.scaler_tls_key_file, config.scaler_tls_ca_file)
    if any(tls) and not all(tls):
        raise ConfigError(
            "mutual TLS needs all of NOCTAYA_SCALER_TLS_CERT_FILE, _KEY_FILE and _CA_FILE"
        )
    return config


def _check_upload_bounds(config: GatewayConfig) -> None:
    """Every bound on bodies still arriving must let one largest body through."""
    if config.upload_bytes < config.max_body_bytes:
        raise ConfigError("NOCTAYA_MAX_UPLOAD_BYTES must be >= NOCTAYA_MAX_BODY_BYTES")
    if 0 < config.upload_bytes_per_address < config.max_body_bytes:
        raise ConfigError("NOCTAYA_MAX_UPLOAD_BYTES_PER_ADDRESS must be 0 or >= NOCTAYA_MAX_BODY_BYTES")
