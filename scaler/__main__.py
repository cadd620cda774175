"""``python -m scaler aggregate`` (aggregate scaler: HTTP reports + gRPC ExternalScaler),
``python -m scaler local`` (the gRPC ExternalScaler of a single gateway, fed demand on stdin by the
gateway that starts it; see scaler/pipe.py) and ``python -m scaler gen-proto`` (regenerate the
committed gRPC stubs)."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["main", "build_parser"]


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer") from None


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a number") from None


def _add_scaler_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Flags of the gRPC ExternalScaler, shared by `aggregate` and `local`."""
    parser.add_argument("--host", default=env.get("NOCTAYA_LISTEN_HOST") or "0.0.0.0", help="bind address")
    parser.add_argument("--scaler-port", type=int, default=_env_int(env, "NOCTAYA_SCALER_PORT", 9090))
    parser.add_argument("--scaling-target", type=int, default=_env_int(env, "NOCTAYA_SCALING_TARGET", 10))
    parser.add_argument("--metric-name", default=env.get("NOCTAYA_METRIC_NAME", "noctaya-demand"))
    parser.add_argument("--scaler-tls-cert-file", default=env.get("NOCTAYA_SCALER_TLS_CERT_FILE", ""))
    parser.add_argument("--scaler-tls-key-file", default=env.get("NOCTAYA_SCALER_TLS_KEY_FILE", ""))
    parser.add_argument("--scaler-tls-ca-file", default=env.get("NOCTAYA_SCALER_TLS_CA_FILE", ""))
    parser.add_argument("--drain-grace-seconds", type=float,
                        default=_env_float(env, "NOCTAYA_DRAIN_GRACE_SECONDS", 5.0),
                        help="grace for in-flight gRPC calls on shutdown (streams end with OK at once)")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="python -m scaler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    agg = sub.add_parser("aggregate", help="run the aggregate scaler (HTTP 9091 reports, gRPC 9090)",
                         description="Every flag defaults to its NOCTAYA_* environment variable. With the "
                         "scaler TLS files the reports are served over TLS with the same certificate.")
    _add_scaler_flags(agg, env)
    agg.add_argument("--report-port", type=int, default=_env_int(env, "NOCTAYA_REPORT_PORT", 9091))
    agg.add_argument("--aggregator-token-file", default=env.get("NOCTAYA_AGGREGATOR_TOKEN_FILE", ""))
    agg.add_argument("--aggregator-previous-token-file",
                     default=env.get("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", ""),
                     help="the previous epoch's token, also accepted during a rotation")
    agg.add_argument("--max-members", type=int, default=_env_int(env, "NOCTAYA_MAX_MEMBERS", 64))
    agg.add_argument("--max-models", type=int, default=_env_int(env, "NOCTAYA_MAX_MODELS", 256),
                     help="distinct models shared gateways may report at once (a model table holds at most 256)")
    agg.add_argument("--max-member-demand", type=int, default=_env_int(env, "NOCTAYA_MAX_MEMBER_DEMAND", 100))
    agg.add_argument("--member-ttl-seconds", type=float,
                     default=_env_float(env, "NOCTAYA_MEMBER_TTL_SECONDS", 10.0))
    agg.add_argument("--max-concurrent-reports", type=int,
                     default=_env_int(env, "NOCTAYA_MAX_CONCURRENT_REPORTS", 16))
    agg.add_argument("--max-members-per-address", type=int,
                     default=_env_int(env, "NOCTAYA_MAX_MEMBERS_PER_ADDRESS", 2),
                     help="members one source address may hold (raise it where gateways share an address, "
                          "e.g. behind SNAT)")
    agg.add_argument("--max-connections-per-address", type=int,
                     default=_env_int(env, "NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", 4))
    agg.add_argument("--report-server-name", default=env.get("NOCTAYA_REPORT_SERVER_NAME", ""),
                     help="with TLS: the name gateways dial; the certificate is checked at startup to carry "
                          "it and to verify against the CA file, as a gateway will")
    agg.add_argument("--report-deadline-seconds", type=float,
                     default=_env_float(env, "NOCTAYA_REPORT_DEADLINE_SECONDS", 2.0),
                     help="time a report request may take to arrive whole (slow clients are cut off)")

    local = sub.add_parser("local", help="serve the gRPC scaler of one gateway, reading its demand from stdin",
                           description="Started by `python -m gateway` in scaler mode local; it exits when "
                           "stdin closes. Every flag defaults to its NOCTAYA_* environment variable.")
    _add_scaler_flags(local, env)

    sub.add_parser("gen-proto", help="regenerate scaler/externalscaler_pb2*.py from proto/")
    return parser


def _scaler_settings(args: argparse.Namespace) -> tuple[object, object]:
    """ScalerSettings and TLS files from the shared flags; ValueError on bad values."""
    from scaler.service import ScalerSettings
    from scaler.tls import tls_files_from_env

    settings = ScalerSettings(metric_name=args.metric_name, target=args.scaling_target)
    tls = tls_files_from_env({
        "NOCTAYA_SCALER_TLS_CERT_FILE": args.scaler_tls_cert_file,
        "NOCTAYA_SCALER_TLS_KEY_FILE": args.scaler_tls_key_file,
        "NOCTAYA_SCALER_TLS_CA_FILE": args.scaler_tls_ca_file,
    })
    return settings, tls


def _start_grpc(args: argparse.Namespace, broadcaster: object, settings: object, tls: object,
                on_activated: Callable[[float], None] | None = None, **options: Any) -> object | None:
    from scaler.service import start_scaler_server

    try:
        return start_scaler_server(broadcaster, args.scaler_port, host=args.host, tls=tls, settings=settings,
                                   on_activated=on_activated, **options)
    except (OSError, ValueError) as exc:  # port in use, unreadable TLS material
        print(f"scaler: cannot start the gRPC scaler: {exc}", file=sys.stderr)
        return None


class _Stop:
    """Set by a signal handler or another thread; the main thread waits for it without waking up
    periodically: a signal caught in any thread writes a byte to the pipe it waits on
    (``signal.set_wakeup_fd``), and so does ``set``."""

    WAIT_SLICE_SECONDS = 60.0  # a bound only: nothing needs the wait to end by itself

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self, *_: object) -> None:
        self._set = True
        try:
            os.write(self._write, b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def wait(self) -> None:
        """Block until set (main thread only)."""
        previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        try:
            while not self._set:
                select.select([self._read], [], [], self.WAIT_SLICE_SECONDS)
                try:
                    os.read(self._read, 4096)
                except BlockingIOError:
                    pass
        finally:
            signal.set_wakeup_fd(previous)


def _wait_for(stop: _Stop) -> None:
    stop.wait()


def _aggregate(args: argparse.Namespace) -> int:
    from scaler.aggregator import Aggregator, AggregatorSettings
    from scaler.demand import DemandBroadcaster
    from scaler.secretfiles import exit_if_a_secret_is_missing

    exit_if_a_secret_is_missing("scaler")

    try:
        settings = AggregatorSettings(
            token_file=args.aggregator_token_file, max_members=args.max_members,
            previous_token_file=args.aggregator_previous_token_file or None,
            max_member_demand=args.max_member_demand, max_models=args.max_models, member_ttl=args.member_ttl_seconds,
            max_concurrent_reports=args.max_concurrent_reports,
            max_members_per_address=args.max_members_per_address,
            max_connections_per_address=args.max_connections_per_address,
            request_deadline=args.report_deadline_seconds,
        )
        scaler_settings, tls = _scaler_settings(args)
    except ValueError as exc:
        print(f"scaler: {exc}", file=sys.stderr)
        return 2

    if tls is not None:
        from scaler.secretfiles import write_termination_message
        from scaler.tls import TLSConfigError, check_served_certificate

        try:
            check_served_certificate(tls, args.report_server_name or None)  # type: ignore[arg-type]
        except TLSConfigError as exc:
            print(f"scaler: gateways could not report here: {exc}", file=sys.stderr)
            write_termination_message(f"gateways could not report here: {exc}")
            return 1

    broadcaster = DemandBroadcaster()
    aggregator = Aggregator(settings, broadcaster)
    # A trigger naming a model (a shared gateway's ScaledObject) gets that model's sum over the
    # gateways; one without gets the sum of everything, as for a per-model gateway. A model nobody
    # reports is answered by the asking ScaledObject when some gateway reports a model for it (a
    # renamed member before the gateways reload), else it is idle.
    scaler = _start_grpc(args, broadcaster, scaler_settings, tls, models=aggregator.reported_model_source,
                         members=aggregator.scaled_object_source, unlisted=aggregator.unlisted_source,
                         model_required=False, on_certificate=aggregator.certificates.listener("scaler"))
    if scaler is None:
        return 1
    aggregator.registry.register(scaler.collector())
    try:
        # With scaler TLS the reports are TLS too, served with the same certificate.
        aggregator.start(args.host, args.report_port, tls=tls)  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:  # port in use, unloadable TLS material
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"scaler: cannot listen for reports on {args.host}:{args.report_port}: {reason}", file=sys.stderr)
        scaler.stop(0)
        return 1
    scheme = "HTTPS" if tls is not None else "HTTP"
    print(f"aggregate scaler: {scheme} reports on {args.host}:{aggregator.port}, gRPC on {args.host}:{scaler.port}",
          file=sys.stderr, flush=True)

    stop = _Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    _wait_for(stop)
    scaler.stop(args.drain_grace_seconds)
    aggregator.stop()
    return 0


def _local(args: argparse.Namespace) -> int:
    from scaler.demand import DemandBroadcaster
    from scaler.pipe import ReportWriter, mirror_demand

    try:
        scaler_settings, tls = _scaler_settings(args)
    except ValueError as exc:
        print(f"scaler: {exc}", file=sys.stderr)
        return 2
    broadcaster = DemandBroadcaster()
    # Both go up the pipe to the gateway, which exports them (it serves /metrics; this process does not).
    reports = ReportWriter(sys.stdout.buffer)
    scaler = _start_grpc(args, broadcaster, scaler_settings, tls, reports.pushed, on_certificate=reports.certificate)
    if scaler is None:
        return 1
    stop = _Stop()
    # The feeding gateway decides when this process ends (it closes our stdin after draining), so a
    # Ctrl-C that reaches the whole process group does not end KEDA's streams before the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    mirror_demand(sys.stdin.buffer, broadcaster, on_eof=stop.set)
    print(f"scaler: gRPC on {args.host}:{scaler.port}, demand from stdin", file=sys.stderr, flush=True)
    _wait_for(stop)
    scaler.stop(args.drain_grace_seconds)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("NOCTAYA_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "gen-proto":
        from scaler.gen_proto import main as gen_main

        return gen_main()
    if args.command == "local":
        return _local(args)
    return _aggregate(args)


if __name__ == "__main__":
    raise SystemExit(main())
