"""`make demo` is the README's main command: prove it runs end to end and scales back to zero."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_demo_scales_from_zero_and_back() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "demo", "--cooldown", "2", "--load-seconds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
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
    ]
    positions = [out.find(s) for s in stages]
    assert all(p >= 0 for p in positions), dict(zip(stages, positions, strict=True))
    assert positions == sorted(positions), out
