"""The engine `make demo` scales from zero: the stand-in (`demo/backend.py`, which "loads" for a few
seconds and echoes) or the real one, llama.cpp's llama-server (ENGINE=llamacpp, or by default once the
test set-up has built it) serving a tiny random GGUF delivered through the prewarm path and started
from the backend Pod the hooks rendered (tests/engines/staged.py, tests/engines/container.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

Say = Callable[[str, str], None]  # demo.__main__.say (passed in: `python -m demo` runs that module as __main__)

# The stand-in's simulated load (the real engine loads in its own time).
STANDIN_LOAD_SECONDS = 3.0


class Engine(Protocol):
    name: str  # which engine served, said in the timeline
    backend_url: str

    def describe(self) -> str: ...

    def start(self) -> Callable[[], None]:
        """Starts the engine; returns what stops it (scale to zero)."""
        ...


class StandInEngine:
    name = "the stand-in demo/backend.py (not a model)"

    def __init__(self, procs: Any, port: int, model: str, load_seconds: float = STANDIN_LOAD_SECONDS) -> None:
        self.procs, self.port, self.model, self.load_seconds = procs, port, model, load_seconds
        self.backend_url = f"http://127.0.0.1:{port}"

    def describe(self) -> str:
        return f"demo/backend.py; it loads for {self.load_seconds:.0f}s before /health passes"

    def start(self) -> Callable[[], None]:
        proc = self.procs.start(["-m", "demo.backend", "--port", str(self.port), "--model", self.model,
                                 "--load-seconds", str(self.load_seconds)])
        return lambda: self.procs.stop(proc)


class LlamaCppEngine:
    """llama-server from the rendered backend Pod of examples/runtimes/llamacpp-cpu-staged.yaml."""

    def __init__(self, workdir: Path, say: Say) -> None:
        from tests.e2e.cluster import private_loopback_address
        from tests.engines import llamacpp, staged

        self.binary = llamacpp.binary_path()
        if not self.binary.exists():
            say("demo", "building llama.cpp's llama-server once (CPU only, 4 to 12 minutes on 2 cores; cached in "
                f"{llamacpp.cache_dir()})")
            llamacpp.llama_server()
        runtime = staged.runtime_doc()
        self.address = private_loopback_address(set(), 8080)
        say("hub", f"stand-in hub holds hf://{staged.REPO_ID} ({staged.GGUF_FILE}, a tiny random llama GGUF)")
        self.backend = staged.deliver(workdir, runtime, self.address, self.binary)
        for line in self.backend.job_output.splitlines():
            if " INFO " in line or "downloading" in line or "promoted" in line:
                say("job", line.split(" ", 3)[-1].replace(str(workdir), "<tmp>")[:150])
        say("pod", "init container wait-for-weights: " + (self.backend.wait_output.strip().splitlines() or ["ok"])[-1])
        self.service: dict[str, Any] = self.backend.service
        self.rendered = self.backend.answer  # with the backend Deployment: the answer once the Job completed
        self.runtime = runtime
        self.backend_url = f"http://{self.address}:8080"
        self.workdir = workdir
        self.say = say
        self.name = f"llama.cpp's llama-server (built from llama-cpp-python {llamacpp.LLAMA_CPP_PYTHON_VERSION}'s sources)"

    def describe(self) -> str:
        argv = self.backend.engine(self.workdir / "describe.log").command.argv
        return "the rendered engine container: llama-server " + " ".join(argv[1:]).replace(str(self.workdir), "<cache>")

    def start(self) -> Callable[[], None]:
        engine = self.backend.engine(self.workdir / "engine.log").start()

        def stop() -> None:
            code = engine.stop()
            said = engine.pre_stop_output.strip().splitlines()
            self.say("backend", f"preStop: {said[-1] if said else '-'}; SIGTERM; llama-server exited {code}")

        return stop


def choose(choice: str, procs: Any, port: int, model: str, workdir: Path, say: Say,
           load_seconds: float = STANDIN_LOAD_SECONDS) -> Engine:
    """``auto``: the real engine when the test set-up built it, else the stand-in."""
    if choice == "auto":
        from tests.engines import llamacpp
        choice = "llamacpp" if llamacpp.binary_path().exists() else "standin"
    if choice == "standin":
        return StandInEngine(procs, port, model, load_seconds)
    if choice == "llamacpp":
        return LlamaCppEngine(workdir, say)
    sys.exit(f"unknown engine {choice!r}: auto, standin or llamacpp")
