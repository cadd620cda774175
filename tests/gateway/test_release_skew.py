"""What issue 41 adds to the contracts between releases, fed to the previous release's gateway
(tests/previous_release.py: its source, run as its image would run it) and back:

- the per-model gateway env this release renders (the endpoint source, balancing options): the
  previous gateway starts from it and serves through the backend address it always used;
- ``balancing.json`` beside a shared gateway's table: invisible to the previous release's reader (it
  reads ``models.json`` only), and this release reads a previous release's table without one.

(A previous gateway refusing this release's *table fields* ``member``/``scaledObject`` is issue 39's.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml

from gateway.config import GatewayConfig
from gateway.modeltable import ModelTableFile
from hooks.render import render_documents
from tests.gateway.fakebackend import FakeBackend
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def rendered_gateway_env(example: str, **balancing: object) -> dict[str, str]:
    docs = list(yaml.safe_load_all((REPO / "examples" / "runtimes" / "vllm-nvidia.yaml").read_text()))
    model = yaml.safe_load((REPO / "examples" / "models" / example).read_text())
    if balancing:
        model["spec"].setdefault("endpoint", {})["balancing"] = balancing
    children = render_documents([*docs, model])
    (gateway,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-gateway")]
    env = {e["name"]: e["value"] for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NOCTAYA_ENDPOINT_SOURCE"] == "endpointslices" and env["NOCTAYA_PREFIX_AFFINITY"] == "false"
    return env


def test_the_previous_gateway_serves_from_this_releases_env(old_tree: Path, tmp_path: Path) -> None:
    backend = FakeBackend().start()
    env = rendered_gateway_env("scale-to-zero.yaml", prefixAffinity=False, coldBatchPerPod=3)
    port, admin = free_port(), free_port()
    env.update({"NOCTAYA_BACKEND_URL": backend.url, "NOCTAYA_LISTEN_HOST": "127.0.0.1",
                "NOCTAYA_LISTEN_PORT": str(port), "NOCTAYA_ADMIN_PORT": str(admin), "NOCTAYA_SCALER_MODE": "off"})
    env = {k: v for k, v in env.items() if not k.endswith(("_SECRET", "_FILE"))}
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("NOCTAYA_", "KUBERNETES_"))}, **env,
            "PYTHONPATH": str(old_tree)}
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=old_tree, env=full, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=5,
                                       json={"model": env["NOCTAYA_SERVED_MODEL_NAME"], "messages": []})
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
        assert answer.status_code == 200, log.read_text()[-2000:]
        assert len(backend.requests_to("/v1/chat/completions")) == 1
    finally:
        proc.terminate()
        proc.wait(30)
        backend.stop()


def _old_reader(old_tree: Path, directory: Path) -> dict:
    script = ("import json, sys\nfrom gateway.config import GatewayConfig\nfrom gateway.modeltable import ModelTableFile\n"
              "base = GatewayConfig(backend_url='http://unused:1', served_model_name='unused')\n"
              "f = ModelTableFile(sys.argv[1], base)\nt = f.poll()\n"
              "print(json.dumps({'error': f.error, 'models': sorted(t.models) if t else None}))\n")
    out = subprocess.run([sys.executable, "-c", script, str(directory / "models.json")], cwd=old_tree, check=True,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(old_tree)})
    return json.loads(out.stdout)


def test_balancing_beside_the_table_is_invisible_to_the_previous_reader(old_tree: Path, tmp_path: Path) -> None:
    table = {"models": [{"name": "a", "backendURL": "http://a-backend.ns.svc:8000", "maxQueue": 4},
                        {"name": "b", "backendURL": "http://b-backend.ns.svc:8000"}]}  # as the previous release writes it
    (tmp_path / "models.json").write_text(json.dumps(table))
    without = _old_reader(old_tree, tmp_path)
    (tmp_path / "balancing.json").write_text(json.dumps({"models": {"a": {"coldBatchPerPod": 2, "prefixAffinity": False}}}))
    assert _old_reader(old_tree, tmp_path) == without == {"error": None, "models": ["a", "b"]}
    ours = ModelTableFile(tmp_path / "models.json", GatewayConfig(backend_url="http://unused:1", served_model_name="u"))
    read = ours.poll()
    assert read is not None and read.models["a"].pod_batch == 2 and read.models["b"].prefix_affinity is True
    (tmp_path / "balancing.json").unlink()  # a previous release's ConfigMap: no balancing.json
    fresh = ModelTableFile(tmp_path / "models.json", GatewayConfig(backend_url="http://unused:1", served_model_name="u"))
    assert sorted(fresh.poll().models) == ["a", "b"]
