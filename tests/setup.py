"""The set-up step: builds or fetches every long third-party test dependency before pytest starts,
outside any per-test timeout (pyproject.toml gives each test 300 s; a first KEDA build alone takes
8-9 minutes on 2 cores).

    python -m tests.setup test   # what `make test` needs (run by `make test` before pytest)
    python -m tests.setup e2e    # what `make e2e` needs (run by `make e2e` before pytest)

Each step calls the same cached function the fixtures call (they then find the binary built), prints
what it builds, a line every 30 s while it runs, and the time it took (or "cached"). A dependency
that cannot be had for a reason the tests treat as a skip (no Go, no copy of shared/ beside the clone,
NOCTAYA_SKIP_KUBE=1, not root for apt-get) is reported as skipped and the tests skip with the same
reason; a build or download that fails exits 1 naming the step. Steps run one after another: on
2 cores, kwok and Metacontroller built from empty Go caches took 227 s one after the other and 231 s
side by side (docs/benchmarks.md), since each Go build already uses both cores while it compiles.

The same steps also run from tests/conftest.py after collection (when pytest is started directly,
e.g. `pytest tests/kube`), for the collected tests only and again before any test's timeout starts.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_SECONDS = 30.0


@dataclass(frozen=True)
class Step:
    name: str
    what: str  # shown while it runs
    targets: frozenset[str]  # make targets that need it
    paths: tuple[str, ...]  # test paths (relative to the repository) that need it
    present: Callable[[], bool]  # already built / installed (no work to do)
    run: Callable[[], object]  # builds; raises the module's "unavailable" or "failed" exception


# --- the steps ----------------------------------------------------------------------------------


def _kube_present() -> bool:
    from tests.kube.apiserver import _built, cache_dir
    return os.environ.get("NOCTAYA_SKIP_KUBE") != "1" and _built(cache_dir() / "bin")


def _kube_run() -> object:
    from tests.kube.apiserver import ensure_binaries
    return ensure_binaries()


CRD_MODULES = ("KEDA_MODULE", "PROMETHEUS_OPERATOR_MODULE", "CERT_MANAGER_MODULE")


def _go_mod_cache() -> Path | None:
    if shutil.which("go") is None:
        return None
    out = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=60, check=False)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def _escaped(module: str) -> str:
    """Go's module-cache path encoding (upper case letters as !lower)."""
    return "".join(f"!{c.lower()}" if c.isupper() else c for c in module)


def _modules_present(variables: Iterable[str]) -> Callable[[], bool]:
    def present() -> bool:
        from tests.third_party import _pinned
        cache = _go_mod_cache()
        return cache is not None and all((cache / _escaped(_pinned(v))).is_dir() for v in variables)
    return present


def _modules_run(variables: Iterable[str]) -> Callable[[], object]:
    def run() -> object:
        from tests.third_party import module_dir
        return [module_dir(v) for v in variables]
    return run


def _module_binary_present(variable: str, name: str) -> Callable[[], bool]:
    def present() -> bool:
        from tests.kube.gobuild import module_binary_path
        return module_binary_path(variable, name).exists()
    return present


def _helm_run() -> object:
    from tests.kube.gobuild import helm_binary
    return helm_binary()


def _promtool_run() -> object:
    from tests.kube.gobuild import promtool_binary
    return promtool_binary()


def _kwok_run() -> object:
    from tests.kube.gobuild import kwok_binary
    return kwok_binary()


def _keda_run() -> object:
    from tests.kube.gobuild import keda_operator_binary
    return keda_operator_binary()


def _metacontroller_present() -> bool:
    from tests.e2e.cluster import metacontroller_binary_path
    path = metacontroller_binary_path()
    return path is not None and path.exists()


def _metacontroller_run() -> object:
    from tests.e2e.cluster import metacontroller_binary
    return metacontroller_binary()


def _release_present() -> bool:
    from tests.previous_release import present
    return present()


def _release_run() -> object:
    from tests.previous_release import source_tree
    return source_tree()


def _llama_server_present() -> bool:
    from tests.engines.llamacpp import binary_path
    return binary_path().exists()


def _llama_server_run() -> object:
    from tests.engines.llamacpp import llama_server
    return llama_server()


def _registry_present() -> bool:
    return shutil.which("docker-registry") is not None


def _registry_run() -> object:
    from tests.prewarm.registry import install_registry_binary
    return install_registry_binary()


TEST, E2E = frozenset({"test"}), frozenset({"e2e"})
BOTH = TEST | E2E

STEPS: tuple[Step, ...] = (
    Step("kube-control-plane", "etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl "
         "(tools/kube-testenv/build.sh)", BOTH, ("tests/kube/", "tests/e2e/"), _kube_present, _kube_run),
    Step("crd-modules", "KEDA, Prometheus Operator and cert-manager Go modules (their CRDs; go mod download)", BOTH,
         ("tests/kube/", "tests/e2e/", "tests/hooks/"), _modules_present(CRD_MODULES), _modules_run(CRD_MODULES)),
    Step("previous-release", "the previous release's source (tests/previous_release.py; git archive from this clone)",
         BOTH, ("tests/hooks/test_upgrade_compat.py", "tests/kube/test_upgrade_compat.py", "tests/e2e/"),
         _release_present, _release_run),
    Step("helm", "helm from HELM_MODULE", BOTH, ("tests/kube/test_chart.py", "tests/e2e/test_upgrade.py"),
         _module_binary_present("HELM_MODULE", "helm"), _helm_run),
    Step("promtool", "promtool from PROMETHEUS_MODULE", TEST, ("tests/kube/test_rules.py",),
         _module_binary_present("PROMETHEUS_MODULE", "promtool"), _promtool_run),
    Step("docker-registry", "Debian's docker-registry (apt-get; the OCI staging tests' registry)", TEST,
         ("tests/prewarm/test_oci.py",), _registry_present, _registry_run),
    Step("llama-server", "llama.cpp's llama-server, CPU only, from llama-cpp-python's sdist on PyPI (tests/engines/llamacpp.py)",
         BOTH, ("tests/engines/", "tests/e2e/", "tests/test_demo.py"), _llama_server_present, _llama_server_run),
    Step("kwok", "kwok from KWOK_MODULE", E2E, ("tests/e2e/",), _module_binary_present("KWOK_MODULE", "kwok"), _kwok_run),
    Step("keda-operator", "KEDA's operator from KEDA_MODULE", E2E, ("tests/e2e/",),
         _module_binary_present("KEDA_MODULE", "keda-operator"), _keda_run),
    Step("metacontroller", "Metacontroller from ../shared/third_party/metacontroller's source", E2E, ("tests/e2e/",),
         _metacontroller_present, _metacontroller_run),
)


# --- running them -------------------------------------------------------------------------------


class StepFailed(Exception):
    def __init__(self, step: Step, seconds: float, reason: str) -> None:
        super().__init__(f"set-up step '{step.name}' ({step.what}) failed after {seconds:.0f}s: {reason}")
        self.step = step


@dataclass
class Outcome:
    step: Step
    state: str  # cached, built, skipped, failed
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    reason: str = ""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _unavailable_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(failed, unavailable) exception types: a failed build is also an "unavailable" (the tests skip
    on both), so it is checked first."""
    from tests.kube.apiserver import KubeBuildFailed, KubeUnavailable
    from tests.prewarm.registry import RegistryInstallFailed, RegistryUnavailable
    from tests.third_party import BuildFailed, ThirdPartyUnavailable
    return (KubeBuildFailed, BuildFailed, RegistryInstallFailed), (KubeUnavailable, ThirdPartyUnavailable, RegistryUnavailable)


def run_step(step: Step, label: str, say: Callable[[str], None], *, quiet_when_cached: bool = False) -> Outcome:
    if step.present():
        if not quiet_when_cached:
            say(f"{label} {step.name}: cached")
        return Outcome(step, "cached")
    failed_types, unavailable_types = _unavailable_types()
    say(f"{label} {step.name}: building {step.what}")
    started, cpu0 = time.monotonic(), _children_cpu()
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            say(f"{label} {step.name}: still building, {time.monotonic() - started:.0f}s")

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        step.run()
    except failed_types as exc:
        return Outcome(step, "failed", time.monotonic() - started, _children_cpu() - cpu0, str(exc))
    except unavailable_types as exc:
        say(f"{label} {step.name}: skipped: {exc} (the tests that need it skip with this reason)")
        return Outcome(step, "skipped", time.monotonic() - started, reason=str(exc))
    finally:
        stop.set()
        beat.join()
    seconds, cpu = time.monotonic() - started, _children_cpu() - cpu0
    say(f"{label} {step.name}: done in {seconds:.0f}s (CPU {cpu:.0f}s)")
    return Outcome(step, "built", seconds, cpu)


def _say(line: str) -> None:
    print(f"[setup {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def steps_for_target(target: str) -> list[Step]:
    return [s for s in STEPS if target in s.targets]


def steps_for_paths(paths: Iterable[str]) -> list[Step]:
    wanted = set(paths)
    return [s for s in STEPS if any(p.startswith(prefix) for p in wanted for prefix in s.paths)]


def prepare(steps: list[Step], say: Callable[[str], None] = _say, *, quiet_when_cached: bool = False,
            fail_fast: bool = True) -> list[Outcome]:
    """Run ``steps`` in order. With ``fail_fast`` raise StepFailed on the first failed build."""
    outcomes = []
    for i, step in enumerate(steps, 1):
        outcome = run_step(step, f"({i}/{len(steps)})", say, quiet_when_cached=quiet_when_cached)
        outcomes.append(outcome)
        if outcome.state == "failed":
            error = StepFailed(step, outcome.seconds, outcome.reason)
            if fail_fast:
                raise error
            say(f"{error} (the tests that need it skip with this reason)")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.setup", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=["test", "e2e"], help="the make target to prepare for")
    args = parser.parse_args(argv)
    steps = steps_for_target(args.target)
    _say(f"make {args.target}: {len(steps)} third-party dependencies ({', '.join(s.name for s in steps)})")
    started = time.monotonic()
    try:
        outcomes = prepare(steps)
    except StepFailed as exc:
        _say(f"FAILED: {exc}")
        return 1
    counts = {state: sum(o.state == state for o in outcomes) for state in ("built", "cached", "skipped")}
    _say(f"make {args.target}: ready in {time.monotonic() - started:.0f}s "
         f"({counts['built']} built, {counts['cached']} cached, {counts['skipped']} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
