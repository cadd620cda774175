"""`make demo` is the README's main command: prove it runs end to end and scales back to zero."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_demo(*args: str) -> tuple[str, str]:
    """``python <args>``'s stdout and stderr; it must exit 0. In its own process group: if it hangs, the demo
    and everything it started (hook server, gateway, backend) are killed together instead of
    outliving the test."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is still running
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            out, err = proc.communicate()
    assert proc.returncode == 0, out + err
    return out, err


@pytest.mark.timeout(240)
def test_demo_scales_from_zero_and_back() -> None:
    out, _ = run_demo("-m", "demo", "--engine", "standin", "--cooldown", "2", "--load-seconds", "1")
    # The timeline shows each stage, in order.
    stages = [
        "POST /v1/llmservice/sync",
        "child Deployment/",
        "GET /v1/models while cold",
        "StreamIsActive pushed true",
        "scaling backend 0 → 1",
        "first token after",
        "answer: 'You said: wake up and say hello'",
        "warm answer in",
        "scaling backend 1 → 0",
        "scaled back to zero",
        "cold start as the gateway timed it: admission → push",
        "status.lastColdStart",
    ]
    positions = [out.find(s) for s in stages]
    assert all(p >= 0 for p in positions), dict(zip(stages, positions, strict=True))
    assert positions == sorted(positions), out
    # The breakdown ends the timeline: the backend "loads" for 1 s (--load-seconds), so push → ready
    # and the Pod's model load say about that.
    gateway_line = next(line for line in out.splitlines() if "cold start as the gateway timed it" in line)
    assert re.search(r"push → ready [12]\.\d+s", gateway_line), gateway_line
    record = re.search(r"modelLoad (\d+)s, total (\d+)s", out)
    assert record and int(record[1]) in (1, 2) and int(record[2]) >= int(record[1]), out


@pytest.mark.timeout(240)
def test_demo_with_the_real_engine_says_so_and_shows_its_load_phase() -> None:
    """`make demo ENGINE=llamacpp`: llama-server (built by the set-up step) from the rendered Pod, its
    tiny model through the prewarm path; the timeline names the engine and its /health changes."""
    from tests.engines import llamacpp

    if not llamacpp.binary_path().exists():  # the set-up step builds it or fails saying why: no skip
        pytest.fail("llama-server is not built here: `python -m tests.setup test` (its llama-server step) says why")
    out, _ = run_demo("-m", "demo", "--engine", "llamacpp", "--cooldown", "2")
    stages = [
        "promoted <tmp>/cache/",  # the prewarm Job's own line
        "wait-for-weights: ",
        "engine: llama.cpp's llama-server",
        "GET /v1/models while cold",
        "scaling backend 0 → 1 (starting the rendered engine container: llama-server --model <cache>/",
        "first token after",
        "(from llama.cpp's llama-server",
        "preStop: noctaya drain: nothing in flight",
        "llama-server exited 0",
        "scaled back to zero",
    ]
    positions = [out.find(s) for s in stages]
    assert all(p >= 0 for p in positions), dict(zip(stages, positions, strict=True))
    assert positions == sorted(positions), out
    # The demo's own /health poller and the gateway's prober race to see the engine Ready (50 ms and
    # 100 ms apart): its line comes after the scale-up, before or after the first token.
    assert out.find("/health → 200 (Ready)") > positions[stages.index("scaling backend 0 → 1 (starting the "
                                                                         "rendered engine container: llama-server "
                                                                         "--model <cache>/")], out
    answer = re.search(r"answer: '([^']*)' \(from llama", out)
    assert answer and answer[1].strip() and answer[1].isprintable(), out  # the tiny model's own (random) words


@pytest.mark.timeout(240)
def test_prewarm_demo_fills_the_cache_then_starts_the_backend_from_it() -> None:
    out, err = run_demo("-m", "demo.prewarm", "--size-mib", "6", "--mib-per-second", "4")
    stages = [
        "child Job/qwen-32b-prewarm-",
        "condition Ready=False (PrewarmRunning)",
        "running the Job's command: prewarm hub",
        "downloaded ",
        "(100%)",
        "promoted <cache>/noctaya/hf/Qwen/Qwen2.5-32B-Instruct/main",
        "marker noctaya/hf/Qwen/Qwen2.5-32B-Instruct/main.ready",
        "child Deployment/qwen-32b-backend",
        "condition CacheReady=True (Available)",
        "init container wait-for-weights",
        "is in the cache; starting the engine",
        "HF_HUB_OFFLINE=1, cache readOnly=True, hub token in env: False",
        "loaded 4 files",
        "the backend started from the prewarmed cache",
    ]
    positions = [out.find(s) for s in stages]
    assert all(p >= 0 for p in positions), dict(zip(stages, positions, strict=True))
    assert positions == sorted(positions), out
    assert "hf_demo_token" not in out + err
