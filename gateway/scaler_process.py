"""The in-pod ExternalScaler of a single gateway, run as a supervised child process.

Why a child and not a greenlet: grpc under gevent costs about twice the CPU per call of grpc on
plain threads and shares the gateway's one event loop, so a burst of KEDA polls slowed the data
path and a flood of HTTP traffic slowed IsActive (docs/benchmarks.md, "Scaler"). As a child
(`python -m scaler local`) it gets its own interpreter and core; the gateway still owns all
admission state and mirrors each demand change down a pipe (scaler/pipe.py), newest state only.

The child exits when the pipe closes, so it never outlives the gateway, even after a SIGKILL.
If it dies, the gateway starts a new one (with backoff) and re-sends the current demand.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from gateway.config import GatewayConfig
from scaler.demand import DemandBroadcaster
from scaler.pipe import CERTIFICATE, PUSHED, encode_demand, read_reports

log = logging.getLogger("noctaya.gateway.scaler")

HEALTHY_RUN_SECONDS = 60.0  # a child that ran this long resets the restart backoff
RESEND_SECONDS = 1.0  # re-send even without a change: a restarted child learns the state at once
MAX_BACKOFF_SECONDS = 5.0


def scaler_command(config: GatewayConfig) -> list[str]:
    args = [
        sys.executable, "-m", "scaler", "local",
        "--host", config.listen_host, "--scaler-port", str(config.scaler_port),
        "--scaling-target", str(config.scaling_target), "--metric-name", config.metric_name,
        "--drain-grace-seconds", "2",
    ]
    for flag, path in (("--scaler-tls-cert-file", config.scaler_tls_cert_file),
                       ("--scaler-tls-key-file", config.scaler_tls_key_file),
                       ("--scaler-tls-ca-file", config.scaler_tls_ca_file)):
        if path:
            args += [flag, path]
    return args


def _ignore(_value: float) -> None:
    """A report nobody asked for."""


class ScalerProcess:
    """Starts, feeds and supervises `python -m scaler local` from the gateway's supervisor (an OS
    thread feeds the pipe)."""

    def __init__(self, config: GatewayConfig, broadcaster: DemandBroadcaster,
                 on_pushed: Callable[[float], None] | None = None,
                 on_certificate: Callable[[float], None] | None = None) -> None:
        self._command = scaler_command(config)
        self._broadcaster = broadcaster
        self._reports = {PUSHED: on_pushed or _ignore, CERTIFICATE: on_certificate or _ignore}
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self._feeder: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> ScalerProcess:
        self._spawn()
        self._feeder = threading.Thread(target=self._feed_forever, name="noctaya-scaler-feeder", daemon=True)
        self._feeder.start()
        return self

    def _spawn(self) -> None:
        # Never the gateway's own stdout: the child logs to stderr like the gateway does.
        # Its stdout carries one `pushed <time>` line per activation told to KEDA and one
        # `certificate <notAfter>` line per certificate served (scaler.pipe); read even when nobody
        # listens: a full pipe would block the child.
        self._proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=os.environ.copy(), close_fds=True)
        log.info("scaler process started", extra={"pid": self._proc.pid})
        stdout = self._proc.stdout
        assert stdout is not None
        threading.Thread(target=read_reports, args=(stdout, self._reports), name="noctaya-scaler-reports",
                         daemon=True).start()

    def _feed_forever(self) -> None:
        backoff = 0.25
        while not self._stopping:
            started = time.monotonic()
            try:
                self._feed_until_broken()
            except (BrokenPipeError, OSError, ValueError) as exc:  # ValueError: write to a closed pipe
                if self._stopping:
                    return
                log.warning("scaler process pipe broke", extra={"error": str(exc)})
            if self._stopping:
                return
            self._reap()
            if time.monotonic() - started >= HEALTHY_RUN_SECONDS:
                backoff = 0.25  # a crash after a long healthy run is not a crash loop
            log.warning("scaler process exited; restarting", extra={"backoff_seconds": backoff})
            time.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            if not self._stopping:
                self._spawn()

    def _feed_until_broken(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        stdin = self._proc.stdin
        version, demand = self._broadcaster.snapshot()
        while not self._stopping:
            stdin.write(encode_demand(demand))
            stdin.flush()
            if self._proc.poll() is not None:
                raise BrokenPipeError("scaler process exited")
            version, demand = self._broadcaster.wait_for_change(version, timeout=RESEND_SECONDS)

    def _reap(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def stop(self, grace: float = 5.0) -> None:
        """Close the pipe (the child ends KEDA's streams with OK and exits); kill it after `grace`."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.write(encode_demand(self._broadcaster.current()))
                proc.stdin.close()
            except (OSError, ValueError):
                pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("scaler process did not stop in time; killing it")
            proc.kill()
            proc.wait()
        if self._feeder is not None:
            self._feeder.join(2 * RESEND_SECONDS)
