"""``python -m gateway``: one process for one worker, or a supervisor and ``NOCTAYA_GATEWAY_WORKERS``
worker processes.

**One worker** (the default where the Pod's CPU limit or request rounds to one core, as rendered):
the worker is the whole Pod. It serves the public port on its gevent loop, samples its own demand
in an OS thread, and serves the admin port and KEDA's ExternalScaler (h2, ``scaler.h2server``) on
its control thread, a hub of their own (``gateway.control``), so no load on the public port can
keep the kubelet's probes or KEDA waiting: one process, no supervisor and no scaler child, so an
idle Pod costs one interpreter (docs/benchmarks.md, "Idle footprint"). A crash ends the process and the kubelet restarts the container; its admission
slots die with it, so none leak.

**Several workers:** the supervisor (this module, plain threads, no gevent) creates the Pod's shared state
(``gateway.state.pod``), one ``SO_REUSEPORT`` listening socket per worker on the same port, and forks
the workers; each worker runs its own gevent loop over its own socket (the kernel spreads new
connections across them), and its admin listener on a control thread of its own. The supervisor then owns everything that is one per Pod:

- the demand sampler summing the workers' rows into one ``Demand`` for KEDA, feeding the scaler
  child process (``local``) or the aggregator reporter (``report``);
- restarts: a worker that dies has its tickets returned to the Pod's semaphore and is forked
  again (with backoff), so a crash never leaks admission slots;
- shutdown: SIGTERM is forwarded to every worker; each drains (``gateway.drain``); once all have
  exited the Pod's demand is withdrawn, the scaler child stops, and the process exits 0.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import resource
import select
import signal
import socket as std_socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import gevent

from gateway.backends import endpoint_feed
from gateway.cgroup import cgroup_root, default_workers
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.control import ControlThread
from gateway.drain import Drainer
from gateway.endpointslices import EndpointFeed
from gateway.logs import configure_logging
from gateway.routes import GatewayApp
from gateway.server import GatewayServer, ServedApp, listen_socket, reseed_request_ids
from gateway.state.models import ModelDemand, ModelsSampler
from gateway.state.pod import DemandSampler, PodState
from scaler.demand import DemandBroadcaster
from scaler.secretfiles import exit_if_a_secret_is_missing

__all__ = ["main", "default_workers", "run_worker"]

log = logging.getLogger("noctaya.gateway")

RESTART_BACKOFF_SECONDS = (0.1, 0.5, 1.0, 2.0, 5.0)
KILL_MARGIN_SECONDS = 10.0  # after the drain grace + this: workers still alive are killed
# The supervisor's loop is woken by signals (a worker's exit, SIGTERM), not by a timer; these bound
# its waits all the same: a long one while serving, a short one while draining (the kill deadline).
IDLE_WAIT_SECONDS = 5.0
DRAIN_WAIT_SECONDS = 0.05
SCALER_STOP_GRACE_SECONDS = 5.0
IN_PROCESS_STREAM_WAIT_SECONDS = 30.0
GC_THRESHOLD = 50_000  # young-generation allocations between cyclic collections (see run_worker)
_PR_SET_PDEATHSIG = 1


def raise_file_limit() -> int:
    """Lift the soft open-file limit to the hard one: every held request is a client socket (and,
    once forwarded, a backend socket), so the default soft limit of 1024 would cap the queue long
    before ``maxQueue``. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return soft


Listeners = tuple[std_socket.socket, std_socket.socket]  # (public, admin) of one worker


def run_worker(config: GatewayConfig, pod: PodState | None, index: int, listeners: Listeners, *, forked: bool = True,
               app_factory: Callable[[EndpointFeed | None, str], ServedApp] | None = None,
               control: ControlThread | None = None) -> int:
    """Body of a worker (forked, or the one-worker Pod's only process): serve until SIGTERM has
    drained it. ``app_factory(feed, namespace)``: another app than one model's (a shared gateway's).
    Each worker watches the backend's Pods itself (its own thread) and balances its own requests.
    ``control``: the thread serving the admin port (the one-worker Pod's, which also serves its
    scaler); a forked worker starts its own."""
    if forked:
        gevent.reinit()
        reseed_request_ids()  # forked workers must not hand out the same ids
    feed, namespace = endpoint_feed(config)
    app = app_factory(feed, namespace) if app_factory is not None else GatewayApp(
        config, pod=pod, worker=index, feed=feed, namespace=namespace)
    public, admin = listeners
    server = GatewayServer(app, public, max_connections=config.max_connections, admin_listener=admin, control=control)
    server.start()
    drainer = Drainer(server, config.drain_grace_seconds, delay=config.drain_delay_seconds)
    gevent.signal_handler(signal.SIGTERM, drainer.begin)
    gevent.signal_handler(signal.SIGINT, drainer.begin)
    # Everything allocated so far lives for the whole process: keep it out of the cyclic GC's
    # scans, so collections during traffic are short (they show up directly in tail latency).
    gc.collect()
    gc.freeze()
    # The data path's objects are acyclic and die by reference counting; a young-generation
    # collection every 700 allocations only costs tail latency. Collect far less often.
    gc.set_threshold(GC_THRESHOLD, 50, 100)
    drainer.done.wait()
    if feed is not None:
        feed.close()
    return 0


class Supervisor:
    def __init__(self, config: GatewayConfig, workers: int) -> None:
        self.config = config
        self.workers = workers
        self.pod = PodState(workers, config.max_queue, config.max_held_body_bytes)
        self.broadcaster = DemandBroadcaster()
        self.pids: dict[int, int] = {}  # pid -> worker index
        self.restarts = [0] * workers
        self.draining = False
        self._drain_started = 0.0
        self._port = config.listen_port
        self._admin_port = config.admin_port
        self._parent = os.getpid()

    # -- workers ---------------------------------------------------------------------------------
    def _listeners(self) -> Listeners:
        public = listen_socket(self.config.listen_host, self._port, reuse_port=True)
        admin = listen_socket(self.config.listen_host, self._admin_port, reuse_port=True, backlog=64)
        # An ephemeral port (0) is resolved once, then shared by every worker.
        self._port, self._admin_port = public.getsockname()[1], admin.getsockname()[1]
        return public, admin

    def _fork(self, index: int, listeners: Listeners, others: Sequence[std_socket.socket] = ()) -> int:
        for handler in logging.getLogger().handlers:
            handler.flush()
        pid = os.fork()
        if pid:
            self.pids[pid] = index
            return pid
        code = 1
        try:
            signal.set_wakeup_fd(-1)  # the supervisor's (a restarted worker is forked inside run())
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            _die_with_parent(self._parent)
            for sock in others:
                sock.close()
            # Nothing of the supervisor's but the listeners (a restarted worker would otherwise keep
            # e.g. the scaler child's stdin open, and with it the child, past the supervisor's death).
            low, high = sorted(sock.fileno() for sock in listeners)
            os.closerange(3, low)
            os.closerange(low + 1, high)
            os.closerange(high + 1, _max_fd())
            code = run_worker(self.config, self.pod, index, listeners)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into the supervisor
            log.error("worker failed", extra={"worker": index, "error": type(exc).__name__})
        finally:
            os._exit(code)

    def start(self) -> None:
        pairs = [self._listeners() for _ in range(self.workers)]
        for index, pair in enumerate(pairs):
            self._fork(index, pair, [s for other in pairs if other is not pair for s in other])
        for pair in pairs:
            for sock in pair:
                sock.close()
        log.info("gateway listening", extra={"port": self._port, "admin_port": self._admin_port,
                                             "workers": self.workers, "backend": self.config.backend_netloc})

    def _reap(self) -> None:
        while self.pids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            index = self.pids.pop(pid, None)
            if index is None:
                continue  # the scaler child is reaped by its own supervisor thread
            tickets, held = self.pod.reclaim(index)
            if self.draining:
                continue
            code = os.waitstatus_to_exitcode(status)
            log.error("worker exited; restarting",
                      extra={"worker": index, "exit": code, "tickets_returned": tickets, "bytes_returned": held})
            delay = RESTART_BACKOFF_SECONDS[min(self.restarts[index], len(RESTART_BACKOFF_SECONDS) - 1)]
            self.restarts[index] += 1
            time.sleep(delay)
            pair = self._listeners()
            self._fork(index, pair)
            for sock in pair:  # the child has them; the supervisor must never hold a socket it does not accept on
                sock.close()

    def begin_drain(self, *_: object) -> None:
        if self.draining:
            return
        self.draining = True
        self._drain_started = time.monotonic()
        log.info("draining", extra={"workers": len(self.pids)})
        for pid in list(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(self, shutdown_steps: list[Callable[[], None]], sampler: DemandSampler) -> int:
        # Signals wake the loop: whichever thread the kernel hands one to, its handler writes a byte
        # to this pipe (signal.set_wakeup_fd), so an idle supervisor sleeps instead of polling.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGTERM, self.begin_drain)
        signal.signal(signal.SIGINT, self.begin_drain)
        signal.signal(signal.SIGCHLD, _woken)  # a worker exited: reap (and restart) it at once
        previous_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        kill_after = self.config.drain_grace_seconds + KILL_MARGIN_SECONDS
        try:
            while True:
                self._reap()
                if self.draining:
                    if not self.pids:
                        break
                    if time.monotonic() - self._drain_started > kill_after:
                        for pid in list(self.pids):
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                select.select([wake_r], [], [], DRAIN_WAIT_SECONDS if self.draining else IDLE_WAIT_SECONDS)
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        finally:
            signal.set_wakeup_fd(previous_fd)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
        _shut_down(shutdown_steps, sampler)
        return 0


def _woken(*_: object) -> None:
    """SIGCHLD's handler: its only job is the byte signal.set_wakeup_fd writes for it."""


def _max_fd() -> int:
    try:
        return min(os.sysconf("SC_OPEN_MAX"), 1 << 20)
    except (OSError, ValueError):
        return 65536


def _die_with_parent(parent: int) -> None:
    """A worker must not outlive a killed supervisor (it would hold the port with no scaler)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _start_scaler(config: GatewayConfig, broadcaster: DemandBroadcaster, pod: PodState, *,
                  control: ControlThread | None = None) -> list[Callable[[], None]]:
    """Start the demand sink of the configured scaler mode; returns its shutdown steps. Either
    records in `pod` when demand was pushed active (the workers time activations by it). In
    ``local`` mode a one-worker Pod serves the ExternalScaler in-process on its ``control``
    thread; a supervisor runs it as a child process, on a core of its own."""
    if config.scaler_mode == "local":
        if control is not None:
            return _start_h2_scaler(config, broadcaster, control, on_activated=pod.mark_pushed,
                                    on_certificate=pod.mark_scaler_certificate)
        from gateway.scaler_process import ScalerProcess

        scaler = ScalerProcess(config, broadcaster, pod.mark_pushed, pod.mark_scaler_certificate).start()
        return [lambda: scaler.stop(grace=SCALER_STOP_GRACE_SECONDS)]
    if config.scaler_mode == "report":
        from scaler.reporter import DemandReporter

        assert config.aggregator_url and config.aggregator_token_file
        reporter = DemandReporter(config.aggregator_url, config.aggregator_token_file, broadcaster,
                                  previous_token_file=config.aggregator_previous_token_file,
                                  ca_file=config.aggregator_ca_file, on_pushed=pod.mark_pushed).start()
        return [lambda: reporter.stop(withdraw=True)]
    return []


def _start_h2_scaler(config: GatewayConfig, broadcaster: DemandBroadcaster, control: ControlThread,
                     **kwargs: Any) -> list[Callable[[], None]]:
    """The ExternalScaler on the control thread's hub, beside the admin port and away from the
    worker's loop (``kwargs``: what the per-model or the shared gateway adds, see
    ``start_h2_scaler_server``); returns its shutdown step."""
    from scaler.externalscaler import ScalerSettings
    from scaler.h2server import start_h2_scaler_server
    from scaler.tls import TLSFiles

    tls = None
    if config.scaler_tls_cert_file:  # load_config has checked the three files come together
        assert config.scaler_tls_key_file and config.scaler_tls_ca_file
        tls = TLSFiles(config.scaler_tls_cert_file, config.scaler_tls_key_file, config.scaler_tls_ca_file)
    # Streams wait on the broadcaster, woken by every flip (and by a cancel; the sampler's thread
    # wakes the control hub through its loop): a slice that long only bounds a wait nothing can
    # miss, and keeps an idle Pod asleep.
    settings = ScalerSettings(metric_name=config.metric_name, target=config.scaling_target,
                              wait_slice=IN_PROCESS_STREAM_WAIT_SECONDS)
    # Built in the control thread: its servers, pools and the streams' waits belong to that hub.
    server = control.call(lambda: start_h2_scaler_server(
        broadcaster, config.scaler_port, host=config.listen_host, settings=settings, tls=tls,
        max_per_address=config.control_connections_per_address, **kwargs))
    return [lambda: control.call(server.stop, SCALER_STOP_GRACE_SECONDS, timeout=SCALER_STOP_GRACE_SECONDS + 10)]


def _shut_down(steps: list[Callable[[], None]], sampler: DemandSampler | ModelsSampler) -> None:
    """After the last worker drained: withdraw the Pod's demand, stop the scaler, stop sampling."""
    sampler.withdraw()
    for step in steps:
        try:
            step()
        except Exception:  # one failing step must not keep the process alive
            log.exception("shutdown step failed")
    sampler.stop()
    log.info("drained")


def _own_listeners(config: GatewayConfig) -> Listeners | None:
    """The public and admin listeners of a one-process Pod (None, logged, when a port is taken). Not
    SO_REUSEPORT: a second gateway process on the same port must fail, not share it."""
    try:
        return (listen_socket(config.listen_host, config.listen_port, reuse_port=False),
                listen_socket(config.listen_host, config.admin_port, reuse_port=False, backlog=64))
    except OSError as exc:
        log.error("cannot listen", extra={"port": config.listen_port, "error": str(exc)})
        return None


def run_single(config: GatewayConfig) -> int:
    """The one-worker Pod: this process serves, samples its demand and answers KEDA (see above)."""
    pod = PodState(1, config.max_queue, config.max_held_body_bytes)
    broadcaster = DemandBroadcaster()
    listeners = _own_listeners(config)
    if listeners is None:
        return 1
    control = ControlThread().start()
    try:
        steps = _start_scaler(config, broadcaster, pod, control=control)
    except Exception as exc:
        log.error("cannot start the scaler", extra={"mode": config.scaler_mode, "error": str(exc)})
        control.stop()
        return 1
    sampler = DemandSampler(pod, broadcaster).start()
    log.info("gateway listening", extra={"port": listeners[0].getsockname()[1],
                                         "admin_port": listeners[1].getsockname()[1], "workers": 1,
                                         "backend": config.backend_netloc})
    try:
        return run_worker(config, pod, 0, listeners, forked=False, control=control)
    finally:
        _shut_down(steps, sampler)
        control.stop()


def run_shared(config: GatewayConfig) -> int:
    """A shared gateway: one process serving every model of the table file, one sampler thread for
    all of them, and the scaler side per model: ``local``, the ExternalScaler on this loop answering
    each ScaledObject from its trigger's ``model`` (with the scaler TLS files, over mutual TLS as a
    per-model gateway's); ``report`` (several replicas), every model's demand sent to the aggregator,
    which answers per model."""
    from gateway.modeltable import ModelTableFile
    from gateway.shared import SharedGatewayApp

    assert config.model_table_file
    table_file = ModelTableFile(config.model_table_file, config)
    table = table_file.poll()
    if table is None:
        log.error("model table refused", extra={"error": table_file.error})
        return 2
    demand = ModelDemand()
    pod = PodState(1, 1, None)  # Pod-wide metrics only (each model has its own state): the scaler's certificate
    listeners = _own_listeners(config)
    if listeners is None:
        return 1
    control = ControlThread().start()
    try:
        steps = _start_shared_scaler(config, demand, pod, control)
    except Exception as exc:
        log.error("cannot start the scaler", extra={"mode": config.scaler_mode, "error": str(exc)})
        control.stop()
        return 1
    sampler = ModelsSampler(demand).start()
    log.info("shared gateway listening", extra={"port": listeners[0].getsockname()[1], "models": len(table.models)})
    try:
        return run_worker(config, None, 0, listeners, forked=False, control=control,
                          app_factory=lambda feed, namespace: SharedGatewayApp(
                              config, table, table_file=table_file, demand=demand, pod=pod, feed=feed,
                              namespace=namespace))
    finally:
        _shut_down(steps, sampler)
        control.stop()


def _start_shared_scaler(config: GatewayConfig, demand: ModelDemand, pod: PodState,
                         control: ControlThread) -> list[Callable[[], None]]:
    """The scaler side of a shared gateway (see run_shared); returns its shutdown steps."""
    if config.scaler_mode == "local":
        return _start_h2_scaler(config, DemandBroadcaster(), control, models=demand.broadcaster, members=demand.by_scaled_object,
                                on_certificate=pod.mark_scaler_certificate)
    if config.scaler_mode == "report":
        from scaler.reporter import DemandReporter

        assert config.aggregator_url and config.aggregator_token_file
        reporter = DemandReporter(config.aggregator_url, config.aggregator_token_file, demand.changes,
                                  previous_token_file=config.aggregator_previous_token_file,
                                  ca_file=config.aggregator_ca_file, models=demand.demands,
                                  scaled_objects=demand.scaled_objects_by_model,
                                  on_model_pushed=demand.mark_pushed).start()
        return [lambda: reporter.stop(withdraw=True)]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    exit_if_a_secret_is_missing("gateway")
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    files = raise_file_limit()
    if files < 2 * config.max_connections + 64:
        log.warning("open-file limit below what max connections need",
                    extra={"limit": files, "max_connections": config.max_connections})
    if config.model_table_file:
        return run_shared(config)
    workers = config.gateway_workers or default_workers(cgroup_root())
    if workers == 1:
        return run_single(config)
    supervisor = Supervisor(config, workers)
    try:
        supervisor.start()  # fork before any thread exists in this process
    except OSError as exc:
        log.error("cannot listen", extra={"port": config.listen_port, "error": str(exc)})
        return 1
    sampler = DemandSampler(supervisor.pod, supervisor.broadcaster).start()
    try:
        shutdown_steps = _start_scaler(config, supervisor.broadcaster, supervisor.pod)
    except Exception as exc:
        log.error("cannot start the scaler", extra={"mode": config.scaler_mode, "error": str(exc)})
        supervisor.begin_drain()
        shutdown_steps = []
    return supervisor.run(shutdown_steps, sampler)

