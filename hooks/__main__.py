"""Command line of the control plane: `python -m hooks serve | render | crds` (`--version`).

Exit codes: 0 success; 1 `crds --check` found a difference; 2 usage error or invalid input; 3 `serve`
refused to start: the image is older than its Deployment's NOCTAYA_EXPECTED_VERSION (or that is no version).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import filecmp
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_DIFFERENT = 1
EXIT_INVALID = 2
EXIT_STALE_IMAGE = 3
YAML_SUFFIXES = (".yaml", ".yml")
WORKERS_ENV = "NOCTAYA_HOOK_WORKERS"
THREADS_ENV = "NOCTAYA_HOOK_THREADS"


class CliError(Exception):
    """An input problem reported as one line on stderr with exit code 2."""


# --------------------------------------------------------------------------------------------- serve


def _prepare_multiprocess_metrics() -> None:
    """Give the gunicorn workers one shared prometheus-client directory (see hooks.metrics).

    Must run before anything imports prometheus_client. A directory passed in by the operator is
    wiped of stale files from a previous run, as prometheus-client requires.
    """
    from hooks.gunicorn_conf import MULTIPROC_DIR_ENV

    configured = os.environ.get(MULTIPROC_DIR_ENV)
    if configured:
        directory = Path(configured)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.db"):
            stale.unlink()
        return
    directory = Path(tempfile.mkdtemp(prefix="noctaya-hooks-metrics-"))
    os.environ[MULTIPROC_DIR_ENV] = str(directory)
    master_pid = os.getpid()

    def remove_when_master_exits() -> None:
        # Forked workers inherit atexit handlers and leave through sys.exit: only the master may
        # remove the directory the other workers are still writing to.
        if os.getpid() == master_pid:
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove_when_master_exits)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {raw}")
    return value


# SIGRTMIN makes a hook server process (master or worker) print every thread's stack to its log
# (docs/troubleshooting.md). faulthandler writes from C, so it answers even when a thread holds the
# GIL or the process is stuck; gunicorn resets its own signals in each worker, never this one.
STACK_DUMP_SIGNAL = signal.SIGRTMIN


def _refuse_a_stale_image() -> bool:
    """Say why and return True when this image is older than the Deployment that runs it; the kubelet
    shows the termination message, and the rollout stops while the old Pods keep serving."""
    from hooks.compat import expected_version_problem
    from scaler.secretfiles import write_termination_message

    problem = expected_version_problem(os.environ)
    if problem is None:
        return False
    print(f"hooks: {problem}", file=sys.stderr, flush=True)
    write_termination_message(problem)
    return True


def _log_start(args: argparse.Namespace) -> None:
    from hooks.compat import EXPECTED_VERSION_ENV, version_info

    line = {"event": "start", **version_info(), "bind": args.bind, "https": bool(args.tls_cert_file)}
    if os.environ.get(EXPECTED_VERSION_ENV):
        line["expectedVersion"] = os.environ[EXPECTED_VERSION_ENV]
    logging.getLogger("noctaya.hooks").info(json.dumps(line, separators=(",", ":")))


def cmd_serve(args: argparse.Namespace) -> int:
    if _refuse_a_stale_image():
        return EXIT_STALE_IMAGE
    _prepare_multiprocess_metrics()
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    _log_start(args)
    from hooks.gunicorn_conf import HookServer, server_options

    def app_factory() -> Any:
        from hooks.app import create_app

        return create_app()

    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise CliError("--tls-cert-file and --tls-key-file go together")
    from scaler.tls import TLSConfigError

    try:
        options = server_options(
            bind=args.bind,
            workers=args.workers,
            threads=args.threads,
            timeout=args.timeout,
            graceful_timeout=args.graceful_timeout,
            loglevel=args.log_level,
            tls_cert_file=args.tls_cert_file or None,
            tls_key_file=args.tls_key_file or None,
        )
    except TLSConfigError as exc:  # names the file, never its content
        raise CliError(f"cannot serve HTTPS: {exc}") from None
    HookServer(app_factory, options).run()
    return 0


# -------------------------------------------------------------------------------------------- render


def _yaml_files(inputs: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in YAML_SUFFIXES)
            if not found:
                raise CliError(f"{path}: directory contains no .yaml or .yml files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise CliError(f"{path}: no such file or directory")
    return files


def _load_documents(path: Path) -> list[dict[str, Any]]:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{path}: cannot read file: {exc}") from exc
    try:
        loaded = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CliError(f"{path}: invalid YAML{where}: {problem}") from exc
    documents: list[dict[str, Any]] = []
    for index, document in enumerate(loaded, start=1):
        if document is None:  # empty document between two `---`
            continue
        if not isinstance(document, dict):
            raise CliError(
                f"{path}: document {index} is a {type(document).__name__}, not a Kubernetes object"
            )
        documents.append(document)
    return documents


def cmd_render(args: argparse.Namespace) -> int:
    import yaml

    documents: list[dict[str, Any]] = []
    sources: list[str] = []
    for path in _yaml_files(args.paths):
        loaded = _load_documents(path)
        documents.extend(loaded)
        sources.extend(str(path) for _ in loaded)
    if not documents:
        raise CliError(f"no documents found in {', '.join(args.paths)}")
    from hooks.render import RenderError, render_documents  # after parsing: file errors come first

    try:
        # `sources` lets the renderer name the file of the object it rejects.
        rendered = render_documents(documents, sources=sources)
    except RenderError as exc:
        raise CliError(str(exc)) from exc
    sys.stdout.write(
        yaml.safe_dump_all(rendered, sort_keys=False, default_flow_style=False, explicit_start=True)
    )
    return 0


# ---------------------------------------------------------------------------------------------- crds


def _crd_differences(out_dir: Path) -> list[str]:
    """What `crds --out out_dir` would change, as human-readable lines (empty: up to date)."""
    from hooks.crdgen import write_crds

    with tempfile.TemporaryDirectory(prefix="noctaya-crds-") as scratch:
        generated = write_crds(Path(scratch))
        generated_names = {Path(p).name for p in generated}
        differences = []
        for name in sorted(generated_names):
            committed = out_dir / name
            if not committed.is_file():
                differences.append(f"{committed}: missing")
            elif not filecmp.cmp(Path(scratch) / name, committed, shallow=False):
                differences.append(f"{committed}: differs from the generated CRD")
    if out_dir.is_dir():
        for stale in sorted(out_dir.glob("*.yaml")):
            if stale.name not in generated_names and "kind: CustomResourceDefinition" in stale.read_text(
                "utf-8"
            ):
                differences.append(f"{stale}: CRD no longer generated")
    return differences


def cmd_crds(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    if args.check:
        differences = _crd_differences(out_dir)
        for line in differences:
            print(line, file=sys.stderr)
        if differences:
            print(
                f"CRDs in {out_dir} are out of date: run `python -m hooks crds --out {out_dir}`",
                file=sys.stderr,
            )
            return EXIT_DIFFERENT
        return 0
    from hooks.crdgen import write_crds

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in write_crds(out_dir):
        print(path)
    return 0


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from hooks.version import __version__

    parser = argparse.ArgumentParser(
        prog="python -m hooks", description="Noctaya control plane: Metacontroller hooks."
    )
    parser.add_argument("--version", action="version", version=f"noctaya {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the hook server (Flask under gunicorn)",
        description="Serve the Metacontroller hooks over HTTP. Environment: "
        "NOCTAYA_HOOK_TOKEN_FILE (bearer token file; unset = no auth), "
        "NOCTAYA_HOOK_MAX_BODY_BYTES, NOCTAYA_EXPECTED_VERSION (refuse to start, exit 3, when this "
        "image is older), plus the HookConfig variables.",
    )
    serve.add_argument(
        "--bind",
        default=os.environ.get("NOCTAYA_HOOK_BIND", "0.0.0.0:8080"),
        help="HOST:PORT to listen on (default %(default)s; env NOCTAYA_HOOK_BIND)",
    )
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=_env_int(WORKERS_ENV, 2),
        help=f"worker processes (default %(default)s; env {WORKERS_ENV})",
    )
    serve.add_argument(
        "--threads",
        type=_positive_int,
        default=_env_int(THREADS_ENV, 4),
        help=f"threads per worker (default %(default)s; env {THREADS_ENV})",
    )
    serve.add_argument(
        "--timeout",
        type=_positive_int,
        default=30,
        help="seconds before a silent worker is restarted (default %(default)s)",
    )
    serve.add_argument(
        "--graceful-timeout",
        type=_positive_int,
        default=20,
        help="seconds in-flight calls get after SIGTERM (default %(default)s)",
    )
    serve.add_argument(
        "--tls-cert-file",
        default=os.environ.get("NOCTAYA_HOOK_TLS_CERT_FILE", ""),
        help="serve HTTPS with this certificate (PEM; reloaded when the file changes, no restart; "
        "env NOCTAYA_HOOK_TLS_CERT_FILE)",
    )
    serve.add_argument(
        "--tls-key-file",
        default=os.environ.get("NOCTAYA_HOOK_TLS_KEY_FILE", ""),
        help="private key of --tls-cert-file (env NOCTAYA_HOOK_TLS_KEY_FILE)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    render = commands.add_parser(
        "render",
        help="render the children of LLMService/InferenceRuntime YAML offline",
        description="Read LLMService and InferenceRuntime YAML (files or directories, "
        "multi-document) and print the objects the hooks would create, as YAML.",
    )
    render.add_argument("paths", nargs="+", metavar="FILE_OR_DIR")
    render.set_defaults(func=cmd_render)

    crds = commands.add_parser(
        "crds",
        help="generate the CRDs from the pydantic models",
        description="Write the CustomResourceDefinitions generated from hooks.api.",
    )
    crds.add_argument("--out", default="crds", help="output directory (default %(default)s)")
    crds.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the files in --out differ from the generated ones",
    )
    crds.set_defaults(func=cmd_crds)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
