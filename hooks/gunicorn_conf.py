"""How `python -m hooks serve` runs the Flask app under gunicorn (programmatically, no config file).

Worker class: ``gthread``. Metacontroller's Go client keeps HTTP connections alive and calls the
hooks from several reconcile workers at once, while kubelet probes and Prometheus scrapes arrive
on their own connections. The ``sync`` worker serves one connection at a time and drops
keep-alive, so a probe could queue behind a slow sync and every hook call would pay a new TCP
handshake. ``gthread`` keeps idle keep-alive connections in a poller (not in a thread) and answers
each request on a bounded thread pool. The hooks are pure CPU-bound Python, so parallelism comes
from worker *processes*; threads only keep a worker responsive. ``gevent`` would buy nothing for a
server that never waits on I/O of its own.

Known limit (gunicorn's, not ours): a *new* connection that sends nothing holds a worker thread
for up to 5 s before gunicorn parks it, so a burst of silent connections delays hook calls. Only
Metacontroller and Prometheus need to reach this server; examples/security restricts it to them.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import Any

from gunicorn.app.base import BaseApplication

from scaler.secretfiles import file_stamp

# Not imported from hooks.metrics: prometheus-client picks its value store when first imported, so
# `serve` must set this variable before anything imports prometheus_client.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

DEFAULT_BIND = "0.0.0.0:8080"
DEFAULT_WORKERS = 2
DEFAULT_THREADS = 4
# Metacontroller aborts a hook call after 10 s (its default webhook timeout); a worker silent for
# 30 s is stuck, not busy. Graceful shutdown lets in-flight calls finish well inside the Pod's
# default 30 s termination grace.
DEFAULT_TIMEOUT_SECONDS = 30
DEFAULT_GRACEFUL_TIMEOUT_SECONDS = 20
# Longer than Go's http.Transport IdleConnTimeout (90 s), so Metacontroller, not the server, closes
# idle connections: a server-side close racing a new request on the same connection is avoided.
DEFAULT_KEEPALIVE_SECONDS = 95
# Bound on open connections (active + idle keep-alive) per worker process.
WORKER_CONNECTIONS = 200


def _child_exit(server: Any, worker: Any) -> None:
    """Let prometheus-client's multiprocess collector drop live-only series of a dead worker."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


class ReloadingTLSContext:
    """gunicorn's ``ssl_context`` hook: one server context per worker, rebuilt when the certificate
    or key file changes (cert-manager or the kubelet swapping a mounted Secret), so a rotated
    certificate is served from the next TLS handshake on, without a restart. gthread asks for the
    context on every new connection; a stat of two files is all that costs. A half-written
    rotation (the files not loadable together) keeps the last good context."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: ssl.SSLContext | None = None
        self._stamp: tuple[tuple[int, int, int], ...] | None = None

    def __call__(self, conf: Any, default_ssl_context_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = file_stamp(conf.certfile, conf.keyfile)
                if self._context is None or stamp != self._stamp:
                    context = default_ssl_context_factory()
                    context.minimum_version = ssl.TLSVersion.TLSv1_2
                    self._context, self._stamp = context, stamp
            except (OSError, ssl.SSLError, ValueError):
                if self._context is None:
                    raise
            return self._context


def server_options(
    bind: str = DEFAULT_BIND,
    workers: int = DEFAULT_WORKERS,
    threads: int = DEFAULT_THREADS,
    timeout: int = DEFAULT_TIMEOUT_SECONDS,
    graceful_timeout: int = DEFAULT_GRACEFUL_TIMEOUT_SECONDS,
    keepalive: int = DEFAULT_KEEPALIVE_SECONDS,
    loglevel: str = "info",
    tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
) -> dict[str, Any]:
    """Gunicorn settings for the hook server (HTTPS when a certificate and key are given)."""
    if workers < 1 or threads < 1:
        raise ValueError("workers and threads must be at least 1")
    tls: dict[str, Any] = {}
    if tls_cert_file and tls_key_file:
        tls = {"certfile": tls_cert_file, "keyfile": tls_key_file, "ssl_context": ReloadingTLSContext()}
    return {
        **tls,
        "bind": bind,
        "workers": workers,
        "worker_class": "gthread",
        "threads": threads,
        "worker_connections": WORKER_CONNECTIONS,
        "timeout": timeout,
        "graceful_timeout": graceful_timeout,
        "keepalive": keepalive,
        # Import the hook modules once in the master: a broken install fails before any fork.
        "preload_app": True,
        # The app logs one structured line per hook call; gunicorn's access log would duplicate it.
        "accesslog": None,
        "errorlog": "-",
        "loglevel": loglevel,
        # gunicorn's control socket defaults to a fixed path under $HOME; two servers on one host
        # (tests, a sidecar) would fight over it, and nothing here uses it.
        "control_socket_disable": True,
        "proc_name": "noctaya-hooks",
        "child_exit": _child_exit,
    }


class HookServer(BaseApplication):
    """A gunicorn application serving the WSGI app returned by ``app_factory``."""

    def __init__(self, app_factory: Callable[[], Any], options: Mapping[str, Any]) -> None:
        self._app_factory = app_factory
        self._options = dict(options)
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        return self._app_factory()
