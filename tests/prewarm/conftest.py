from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from demo.hub import FakeHub, HubRepo

ROOT = Path(__file__).resolve().parents[2]
MAIN, V1 = "1" * 40, "2" * 40
SENTINEL = "hf_SENTINEL_d0n0tl34k_7c1e9a"  # the test greps for it everywhere

pytest.importorskip("huggingface_hub")
pytest.importorskip("modelscope")


def weights(seed: str, size: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += f"{seed}:{counter};".encode()
        counter += 1
    return bytes(out[:size])


MAIN_FILES = {"config.json": b'{"model_type": "llama", "rev": "main"}', "model.safetensors": weights("main", 300_000),
              "tokenizer/tokenizer.json": b'{"version": "1.0"}'}
V1_FILES = {"config.json": b'{"model_type": "llama", "rev": "v1"}', "model-00001.safetensors": weights("v1", 200_000)}


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    repos = {
        "org/model": HubRepo({MAIN: MAIN_FILES, V1: V1_FILES}, {"main": MAIN, "master": MAIN, "v1": V1}),
        "org/private": HubRepo({MAIN: MAIN_FILES}, {"main": MAIN, "master": MAIN}, token=SENTINEL),
    }
    with FakeHub(repos) as server:
        yield server


@dataclass
class Run:
    code: int
    out: str
    termination: str


def run_prewarm(hub: FakeHub, tmp: Path, *args: str, token: str | None = None, secret: str | None = None,
                scheme: str = "hf") -> Run:
    termination = tmp / "termination-log"
    termination.unlink(missing_ok=True)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp), "HF_HOME": str(tmp / "hf-home"),
           "MODELSCOPE_CACHE": str(tmp / "ms-home"), "NOCTAYA_TERMINATION_LOG": str(termination),
           "HF_ENDPOINT": hub.url, "MODELSCOPE_ENDPOINT": hub.url, "NO_PROXY": "*"}
    if token is not None:
        env["HF_TOKEN" if scheme == "hf" else "MODELSCOPE_API_TOKEN"] = token
    if secret is not None:
        env["NOCTAYA_CREDENTIALS_SECRET"] = secret
    proc = subprocess.run([sys.executable, "-m", "prewarm", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    return Run(proc.returncode, proc.stdout + proc.stderr, termination.read_text() if termination.exists() else "")
