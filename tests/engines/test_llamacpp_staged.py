"""The real llama-server started from the backend Pod the hooks render, with its model delivered
through the prewarm path (tests/engines/staged.py): the rendered command, args and env ($(VAR)
expanded as the kubelet does), the cache volume mapped to a local directory, stopped as the kubelet
stops it (the rendered preStop drain, then SIGTERM).

- ``llamacpp-cpu-staged`` serves the prewarmed GGUF; the `openai` client gets the engine's own
  stream through a gateway; the preStop hook finds nothing in flight and the engine exits 0;
- ``llamacpp-cpu`` (``--hf-repo``) with the same prewarmed model cannot start: the reason the staged
  runtime exists, and what a wrong model argument in a runtime looks like;
- a corrupt GGUF: the engine exits, /health never answers 200.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.e2e.cluster import private_loopback_address
from tests.engines import llamacpp, staged
from tests.engines.container import LocalContainer

RUNTIMES = Path(__file__).resolve().parents[2] / "examples" / "runtimes"
PORT = 8080  # the runtime's spec.port: each engine has a private loopback address of its own

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def llama_server() -> Path:
    """Built by the set-up step; a machine that cannot build it fails here with the reason, not a skip."""
    return llamacpp.llama_server()


@pytest.fixture
def address() -> str:
    return private_loopback_address(set(), PORT)


@pytest.fixture
def served(tmp_path: Path, llama_server: Path, address: str) -> Iterator[tuple[staged.StagedBackend, LocalContainer]]:
    backend = staged.deliver(tmp_path, staged.runtime_doc(), address, llama_server)
    engine = backend.engine(tmp_path / "engine.log").start()
    try:
        yield backend, engine
    finally:
        engine.stop()


def test_the_staged_runtime_serves_the_prewarmed_gguf_and_stops_cleanly(
        served: tuple[staged.StagedBackend, LocalContainer], address: str) -> None:
    from openai import OpenAI

    from tests.gateway.abuse_harness import GatewayPod

    backend, engine = served
    assert "HF_HUB_OFFLINE" in engine.command.env and "HF_TOKEN" not in engine.command.env
    model_arg = engine.command.argv[engine.command.argv.index("--model") + 1]
    assert model_arg.endswith(f"/{staged.GGUF_FILE}") and Path(model_arg).is_file(), engine.command.argv
    url = f"http://{address}:{PORT}"
    staged.wait_health(engine, url)
    listed = requests.get(f"{url}/v1/models", timeout=5).json()
    assert [m["id"] for m in listed["data"]] == ["tiny"], listed
    pod = GatewayPod(PORT, NOCTAYA_SERVED_MODEL_NAME="tiny", NOCTAYA_BACKEND_URL=url)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{pod.port}/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1, chunks[-1]
        assert any(c.choices and c.choices[0].delta.content for c in chunks), chunks
    finally:
        pod.stop()
    code = engine.stop()
    assert engine.pre_stop_seconds is not None and "nothing in flight" in engine.pre_stop_output, engine.pre_stop_output
    assert code == 0 and not engine.killed, f"exit {code}, killed {engine.killed}: {engine.log_tail()}"


def test_the_hub_runtime_cannot_load_a_prewarmed_model(tmp_path: Path, llama_server: Path, address: str) -> None:
    """``--hf-repo <local directory>``: what llama-server says when a runtime's model argument is wrong."""
    backend = staged.deliver(tmp_path, staged.runtime_doc(RUNTIMES / "llamacpp-cpu.yaml"), address, llama_server)
    engine = backend.engine(tmp_path / "engine.log").start()
    try:
        assert engine.proc is not None
        code = engine.proc.wait(30)
    finally:
        engine.stop()
    assert code != 0 and "invalid HF repo format" in engine.log_tail(), engine.log_tail()


def test_a_corrupt_gguf_exits_and_never_turns_healthy(tmp_path: Path, llama_server: Path, address: str) -> None:
    good = staged.tiny_gguf.write(tmp_path / "good.gguf").read_bytes()
    corrupt = good[:4096] + bytes(len(good) - 4096)  # the header and key/values, then zeros
    backend = staged.deliver(tmp_path, staged.runtime_doc(), address, llama_server, model=corrupt)
    engine = backend.engine(tmp_path / "engine.log").start()
    healthy = False
    try:
        deadline = time.monotonic() + 30
        while engine.running() and time.monotonic() < deadline:
            try:
                healthy |= requests.get(f"http://{address}:{PORT}/health", timeout=1).status_code == 200
            except requests.RequestException:
                pass
            time.sleep(0.05)
        assert not engine.running(), f"llama-server still running with a corrupt model: {engine.log_tail()}"
    finally:
        engine.stop()
    assert engine.exit_code != 0 and not healthy, engine.log_tail()
