"""``python -m prewarm hub`` (download a hub revision), ``python -m prewarm oci`` (stage an OCI
artifact pinned by digest) and ``python -m prewarm wait`` (the serving Pod's init container).

Exit status: 0 done, 1 failed (the Job retries; the reason is in the log and the termination
message, where the hooks read it for PrewarmFailed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from prewarm.layout import LayoutError, ModelDir
from prewarm.transfer import Limits

DEFAULT_WAIT_TIMEOUT = 6 * 3600


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prewarm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("hub", "download a Hugging Face or ModelScope revision into the cache"),
                            ("oci", "stage an OCI artifact, pinned by its manifest digest, into the cache"),
                            ("wait", "wait until the cache holds the revision (serving Pod init container)")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--source", required=True,
                         help="hf://org/name, modelscope://org/name or oci://registry/repo@sha256:<digest>")
        if name != "oci":
            cmd.add_argument("--revision", default="", help="branch, tag or commit (default: the hub's default branch)")
        cmd.add_argument("--cache-dir", required=True, help="the mounted cache volume")
        if name in ("hub", "oci"):
            cmd.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines")
            cmd.add_argument("--lock-timeout", type=float, default=DEFAULT_WAIT_TIMEOUT,
                             help="give up after waiting this many seconds for another download of the same revision "
                                  "on this cache (it holds <revision>.lock)")
            _add_transfer_options(cmd)
        if name == "oci":
            cmd.add_argument("--docker-config", default=os.environ.get("NOCTAYA_REGISTRY_CONFIG_FILE", ""),
                             help="Docker config JSON with the registry's credentials (env NOCTAYA_REGISTRY_CONFIG_FILE)")
            cmd.add_argument("--plain-http", action="store_true", help="talk to the registry over HTTP (tests, demo)")
        if name == "wait":
            cmd.add_argument("--timeout", type=float, default=DEFAULT_WAIT_TIMEOUT, help="give up after this many seconds")
            cmd.add_argument("--interval", type=float, default=2.0, help="seconds between checks")
    return parser


def _add_transfer_options(cmd: argparse.ArgumentParser) -> None:
    defaults = Limits()
    cmd.add_argument("--min-rate", type=float, default=defaults.min_rate,
                     help="abandon a download when fewer than this many bytes per second arrived over the last "
                          "--stall-window seconds (it frees the revision's lock; the Job retries); 0: no rate check")
    cmd.add_argument("--stall-window", type=float, default=defaults.stall_window,
                     help="seconds over which --min-rate is averaged")
    cmd.add_argument("--read-timeout", type=float, default=defaults.read_timeout,
                     help="abandon a download when one read waits this many seconds for any byte")


def _limits(args: argparse.Namespace) -> Limits:
    if args.min_rate < 0 or args.stall_window <= 0 or args.read_timeout <= 0:
        raise LayoutError("--min-rate must be >= 0, --stall-window and --read-timeout > 0")
    return Limits(min_rate=args.min_rate, stall_window=args.stall_window, read_timeout=args.read_timeout)


def _fail(message: str) -> int:
    from scaler.secretfiles import write_termination_message

    logging.getLogger("noctaya.prewarm").error("%s", message)
    write_termination_message(message)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("NOCTAYA_LOG_LEVEL", "INFO").upper(), stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per HTTP request drowns the progress
    # The hub clients' progress bars redraw with \r: unreadable in `kubectl logs`; ours is a line.
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ.setdefault(var, "1")
    args = build_parser().parse_args(argv)
    try:
        model = ModelDir.of(args.cache_dir, args.source, getattr(args, "revision", "") or None)
        if args.command != "wait" and (args.command == "oci") != (model.scheme == "oci"):
            raise LayoutError(f"`python -m prewarm {args.command}` does not stage {args.source}")
        limits = _limits(args) if args.command != "wait" else Limits()
    except LayoutError as exc:
        print(f"prewarm: {exc}", file=sys.stderr)
        return 2
    if args.command == "wait":
        from prewarm.wait import wait_for_marker

        if wait_for_marker(model, args.timeout, args.interval):
            return 0
        return _fail(f"{model.source}@{model.revision} was not in the cache after {args.timeout:.0f} s: "
                     "see the prewarm Job's status and logs")

    from prewarm.hub import PrewarmError, _token, prewarm, redact

    try:
        if args.command == "oci":
            from prewarm.oci import OciStager, stage
            from scaler.secretfiles import exit_if_a_secret_is_missing

            exit_if_a_secret_is_missing("prewarm")
            stage(model, OciStager(args.docker_config or None, args.plain_http, limits=limits), args.progress_interval,
                  lock_timeout=args.lock_timeout)
        else:
            prewarm(model, progress_interval=args.progress_interval, lock_timeout=args.lock_timeout, limits=limits)
    except PrewarmError as exc:
        return _fail(str(exc))
    except Exception as exc:  # no traceback: a library's locals or messages could carry the token
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        return _fail(redact(f"{model.source}@{model.revision}: unexpected {type(exc).__name__}: {first}", _token()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
