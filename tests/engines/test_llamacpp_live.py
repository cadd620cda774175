"""llama.cpp's own llama-server (tests/engines/llamacpp.py) serving the tiny GGUF
(tests/engines/tiny_gguf.py), behind a real `python -m gateway` from the rendered env, with the real
`openai` client: what Noctaya assumes of the engine, checked against the engine.

- a streamed chat completion through the gateway carries the engine's own chunks, with generated
  text in them, and ends with [DONE]; a non-streamed one its usage;
- the preStop drain program rendered for the example runtime reads the engine's real /metrics: it
  waits while a stream is in flight and returns once it ends.

The metric names every shipped llama.cpp runtime gives are checked against the live engine in
tests/engines/test_runtime_metrics_live.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from hooks.api.runtime import InferenceRuntime
from hooks.runtime import drain
from tests.engines import llamacpp, tiny_gguf
from tests.ports import free_port

RUNTIME = Path(__file__).resolve().parents[2] / "examples" / "runtimes" / "llamacpp-cpu.yaml"
ALIAS = "tiny"

pytestmark = pytest.mark.timeout(120)



class Engine:
    def __init__(self, binary: Path, model: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Options and values as separate words: llama-server refuses --option=value.
        argv = [str(binary), "-m", str(model), "--alias", ALIAS, "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics", "--parallel", "4", "--threads", "1", *extra]
        self.log = model.parent / f"engine-{self.port}.log"
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"llama-server exited: {self.log.read_text()[-2000:]}"
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise AssertionError(f"llama-server not healthy in {timeout}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    binary = llamacpp.llama_server()
    model = tiny_gguf.write(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    served = Engine(binary, model)
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


def test_the_engines_own_stream_through_the_gateway_with_the_openai_client(engine: Engine) -> None:
    from openai import OpenAI

    from tests.gateway.abuse_harness import GatewayPod

    pod = GatewayPod(engine.port, NOCTAYA_SERVED_MODEL_NAME=ALIAS)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{pod.port}/v1", api_key="none", max_retries=0)
        # The tiny model never samples a control token (tests/engines/tiny_gguf.py), so 16 tokens are text.
        stream = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=16, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert chunks and all(c.model == ALIAS for c in chunks if c.model)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1, chunks[-1]
        assert content and "".join(content), f"no generated text in the stream: {chunks}"
        whole = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=4)
        assert whole.usage.completion_tokens >= 1 and whole.choices[0].finish_reason in ("length", "stop")
    finally:
        pod.stop()


def test_the_rendered_prestop_drain_waits_on_the_engines_real_metrics(engine: Engine) -> None:
    doc = yaml.safe_load(RUNTIME.read_text())
    doc["spec"]["port"] = engine.port
    doc["spec"]["lifecycle"] = {"drainTimeout": "60s"}
    hook = drain.pre_stop(InferenceRuntime.model_validate(doc))
    assert hook is not None and "exec" in hook
    argv = hook["exec"]["command"]
    # A stream long enough to be in flight when the hook starts (the tiny model is fast: many tokens).
    done = threading.Event()

    def generate() -> None:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1500,
                "stream": True, "ignore_eos": True}
        with requests.post(f"{engine.url}/v1/chat/completions", json=body, stream=True, timeout=60) as answer:
            for _ in answer.iter_lines():
                pass
        done.set()

    threading.Thread(target=generate, daemon=True).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = requests.get(f"{engine.url}/metrics", timeout=5).text
        if re.search(r"^llamacpp:requests_processing [1-9]", text, re.M):
            break
        time.sleep(0.02)
    else:
        pytest.fail("the stream never showed in llamacpp:requests_processing")
    t0 = time.monotonic()
    out = subprocess.run(argv, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert done.is_set(), f"the hook returned after {took:.1f}s with the stream still running: {out.stdout}"
    assert "nothing in flight" in out.stdout + out.stderr
