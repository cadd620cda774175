"""A llama.cpp model delivered the way users deliver one, on this machine: the tiny GGUF on a
stand-in hub (``demo.hub.FakeHub``, the Hugging Face protocol), an LLMService with ``cache.prewarm``
on the ``llamacpp-cpu-staged`` runtime, the prewarm Job the hooks render run as its container would
run (``python -m prewarm hub`` into a local directory standing in for the cache volume), then the
backend Pod the hooks render once that Job is Complete: its marker-wait init container, then the
engine container, through ``tests.engines.container``.

Used by the real-engine tests and by ``make demo ENGINE=llamacpp``.
"""

from __future__ import annotations

import copy
import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from demo.hub import FakeHub, HubRepo
from hooks.controller import sync
from tests.engines import tiny_gguf
from tests.engines.container import LocalContainer, Sandbox, run_to_completion
from tests.hooks import helpers as h

ROOT = Path(__file__).resolve().parents[2]
STAGED_RUNTIME = ROOT / "examples" / "runtimes" / "llamacpp-cpu-staged.yaml"
REPO_ID = "noctaya/tiny-llama-gguf"
GGUF_FILE = "tiny.gguf"
ENGINE_PROGRAM = "/app/llama-server"  # the path in the runtime's image (examples/runtimes/llamacpp-cpu*.yaml)


def hub_repo(model: bytes) -> HubRepo:
    commit = hashlib.sha1(b"tiny-llama-gguf" + hashlib.sha256(model).digest()).hexdigest()
    files = {GGUF_FILE: model, "README.md": b"A tiny random llama model for Noctaya's real-engine tests.\n"}
    return HubRepo({commit: files}, {"main": commit})


def runtime_doc(path: Path = STAGED_RUNTIME) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def service_doc(runtime: dict[str, Any], hub_url: str, name: str = "tiny", extra_args: tuple[str, ...] = ("--threads", "1"),
                **spec: Any) -> dict[str, Any]:
    """The LLMService: the hub model prewarmed into a SharedPVC, served by ``runtime``. HF_ENDPOINT
    (passed through to the Job, as for a hub mirror) points the Job at the stand-in hub."""
    body: dict[str, Any] = {
        "model": {"source": f"hf://{REPO_ID}"},
        "runtime": {"name": runtime["metadata"]["name"], "args": list(extra_args),
                    "env": [{"name": "HF_ENDPOINT", "value": hub_url}, {"name": "GGUF_FILE", "value": GGUF_FILE}]},
        "resources": {"accelerators": 0},
        "cache": {"strategy": "SharedPVC", "prewarm": True},
        **spec,
    }
    return h.llmservice(name=name, **body)


def _component(answer: dict[str, Any], kind: str, component: str) -> dict[str, Any] | None:
    return next((c for c in answer["children"] if c["kind"] == kind
                 and c["metadata"]["labels"].get("serving.noctaya.io/component") == component), None)


@dataclass
class StagedBackend:
    service: dict[str, Any]  # the LLMService
    answer: dict[str, Any]  # the hooks' answer once the Job completed
    pod_spec: dict[str, Any]  # the backend Deployment's Pod template spec
    sandbox: Sandbox
    job_output: str
    wait_output: str

    def engine(self, log: Path, grace_seconds: float = 30.0) -> LocalContainer:
        container = next(c for c in self.pod_spec["containers"] if c["name"] == "engine")
        return LocalContainer(container, self.sandbox, log, grace_seconds)


def deliver(workdir: Path, runtime: dict[str, Any], address: str, llama_server: Path, *, model: bytes | None = None,
            **spec: Any) -> StagedBackend:
    """Hub → prewarm Job → cache → the backend Pod's init container; the engine not started yet."""
    model = model if model is not None else tiny_gguf.write(workdir / "hub-upload" / GGUF_FILE).read_bytes()
    cache = workdir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    with FakeHub({REPO_ID: hub_repo(model)}) as hub:
        svc = service_doc(runtime, hub.url, **spec)
        first = sync.sync(h.sync_request(svc, runtimes=[runtime]), h.config())
        job = _component(first, "Job", "prewarm")
        assert job is not None and _component(first, "Deployment", "backend") is None, "a prewarm Job first"
        job_spec = job["spec"]["template"]["spec"]
        job_sandbox = Sandbox(address="127.0.0.1", volumes={"model-cache": cache}, programs={"python": sys.executable},
                              cwd=ROOT)
        done = run_to_completion(job_spec["containers"][0], job_sandbox, timeout=120)
        assert done.returncode == 0, f"the prewarm Job failed: {done.stdout[-1500:]}{done.stderr[-1500:]}"
    observed = h.observed_with_jobs_complete(first)
    second = sync.sync(h.sync_request({**svc, "status": first["status"]}, runtimes=[runtime], children=observed),
                       h.config(h.LATER_TIME))
    backend = _component(second, "Deployment", "backend")
    assert backend is not None, f"no backend once the Job completed: {second['status']}"
    pod_spec = copy.deepcopy(backend["spec"]["template"]["spec"])
    sandbox = Sandbox(address=address, volumes={"model-cache": cache}, programs={ENGINE_PROGRAM: str(llama_server)},
                      cwd=workdir)
    waited = run_to_completion(pod_spec["initContainers"][0], sandbox, timeout=60)
    assert waited.returncode == 0, f"the weights wait failed: {waited.stdout}{waited.stderr}"
    return StagedBackend(svc, second, pod_spec, sandbox, done.stdout + done.stderr, waited.stdout)


def wait_health(engine: LocalContainer, url: str, timeout: float = 60.0) -> list[int]:
    """Every distinct /health status seen in order until 200; fails if the engine exits first."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert engine.running(), f"llama-server exited ({engine.proc.poll() if engine.proc else None}): {engine.log_tail()}"
        try:
            code = requests.get(f"{url}/health", timeout=2).status_code
        except requests.RequestException:
            code = 0
        if not seen or seen[-1] != code:
            seen.append(code)
        if code == 200:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"/health not 200 in {timeout}s (saw {seen}): {engine.log_tail()}")
