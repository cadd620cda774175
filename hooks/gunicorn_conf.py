"""How `python -m hooks serve` runs the Flask app under gunicorn (programmatically, no config file).

Worker class: ``gthread``. Metacontroller's Go client keeps HTTP connections alive and calls the
hooks from several reconcile workers at once, while kubelet probes and Prometheus scrapes arrive
on their own connections. The ``sync`` worker serves one connection at a time and drops
keep-alive, so a probe could queue behind a slow sync and every hook call would pay a new TCP
handshake. ``gthread`` keeps idle keep-alive connections in a poller (not in a thread) and answers
each request on a bounded thread pool. The hooks are pure CPU-bound Python, so parallelism comes
from worker *processes*; threads only keep a worker responsive. ``gevent`` would buy nothing for a
server that never waits on I/O of its own.

Over TLS, gthread alone lets idle connections take every thread: it waits for a connection's first
bytes before committing a thread, but the TLS ClientHello *is* those bytes, and the thread then
blocks, without a timeout, in the handshake and in reading a first request that may never come. Go's
HTTP client makes such connections in normal operation (a connection dialled for a request that an
idle one served first goes to the client's idle pool unused), and Metacontroller keeps one client per
hook: four such connections stopped every hook call of an e2e run. :class:`HookWorker` bounds the
handshake and parks a connection without a request in the poller, as gthread does for plain HTTP.

Known limit (gunicorn's, not ours): a client that sends *part* of a request and stops holds a thread
until it sends the rest or hangs up. Only Metacontroller and Prometheus need to reach this server;
examples/security restricts it to them.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.http import get_parser as http_parser
from gunicorn.sock import ssl_wrap_socket
from gunicorn.workers.gthread import _DEFER, ThreadWorker

from scaler.tls import ReloadingServerContext, TLSFiles

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
# A TLS connection's handshake must finish within this, or it is closed.
TLS_HANDSHAKE_TIMEOUT_SECONDS = 10.0
# How long a worker thread waits for a new TLS connection's ClientHello, then for its first request,
# before parking it in the poller. Short: a request on a parked connection costs one poller hop.
TLS_FIRST_BYTES_WAIT_SECONDS = 0.5

_CLOSED = object()  # handle() closed the connection itself: finish_request only counts it gone


class HookWorker(ThreadWorker):
    """gthread with every step of a new TLS connection bounded (see the module docstring): the
    handshake has a deadline, and a connection whose first request does not follow its handshake
    is parked in the poller instead of holding a thread."""

    def handle(self, conn: Any) -> Any:
        if not self.cfg.is_ssl or conn.initialized:
            return super().handle(conn)
        if not conn.wait_for_data(TLS_FIRST_BYTES_WAIT_SECONDS):
            conn.data_ready = False
            return _DEFER
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(TLS_HANDSHAKE_TIMEOUT_SECONDS)
            conn.sock = ssl_wrap_socket(conn.sock, self.cfg)
            if not self.cfg.do_handshake_on_connect:
                conn.sock.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError and a timeout are OSErrors
            self.log.debug("TLS handshake with %s failed: %s", conn.client, exc)
            conn.sock.close()
            return _CLOSED
        conn.initialized = True
        conn.parser = http_parser(self.cfg, conn.sock, conn.client)
        # No request yet: a client's spare keep-alive connection. Wait briefly, then park it; the
        # poller hands it back (data_ready) when the request comes.
        conn.data_ready = bool(conn.sock.pending())  # else gthread's own wait, now on the TLS socket
        if not conn.wait_for_data(TLS_FIRST_BYTES_WAIT_SECONDS):
            return _DEFER
        return super().handle(conn)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A parked connection that never sent a request has nothing in flight: close it at once
        # instead of keeping the graceful shutdown waiting for its keep-alive timeout.
        for conn in self.pending_conns:
            conn.timeout = 0.0
        super().handle_exit(sig, frame)

    def finish_request(self, conn: Any, fs: Any) -> None:
        if not fs.cancelled() and fs.exception() is None and fs.result() is _CLOSED:
            self.nr_conns -= 1
            return
        super().finish_request(conn, fs)


def _child_exit(server: Any, worker: Any) -> None:
    """Let prometheus-client's multiprocess collector drop live-only series of a dead worker."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


class ReloadingTLSContext:
    """gunicorn's ``ssl_context`` hook: the server context of ``scaler.tls.ReloadingServerContext``,
    rebuilt when the certificate or key file changes (cert-manager or the kubelet swapping a mounted
    Secret), so a rotated certificate is served from the next TLS handshake on, without a restart.
    gthread asks for the context on every new connection; a stat of two files is all that costs.
    Material that does not load (a half-written rotation, a key that is not the certificate's) keeps
    the last good context and is logged once. Built in the master, so a certificate that cannot be
    served stops ``serve`` at startup; the workers inherit it and each reloads on its own. Every
    load sets the hook server's certificate-expiry gauge (``hooks.metrics``)."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        from hooks.metrics import record_served_certificate

        self._reloading = ReloadingServerContext(TLSFiles(cert_file, key_file), on_loaded=record_served_certificate)

    def __call__(self, conf: Any, default_ssl_context_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return self._reloading.current()


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
        tls = {"certfile": tls_cert_file, "keyfile": tls_key_file,
               "ssl_context": ReloadingTLSContext(tls_cert_file, tls_key_file)}
    return {
        **tls,
        "bind": bind,
        "workers": workers,
        "worker_class": HookWorker,
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
