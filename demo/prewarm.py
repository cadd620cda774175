"""`python -m demo.prewarm` — model delivery on one machine, with no cluster: a prewarm Job fills the
cache, then the backend starts from it.

What runs (all on 127.0.0.1; real Noctaya code except the clearly labelled stand-ins):

1. a STAND-IN HUB (`demo/hub.py`) speaking the Hugging Face protocol, on a slow link, holding a small
   model at two revisions;
2. the hook server (`python -m hooks serve`), asked to sync `examples/models/sharedpvc-prewarm.yaml`:
   it renders the prewarm Job and no backend yet;
3. the Job's own command and env from the rendered Job (`python -m prewarm hub`, with the real
   `huggingface_hub` client pointed at the stand-in by HF_ENDPOINT), into a local directory standing
   in for the cache volume: progress lines, verification, the atomic promote, the marker;
4. a second sync with the Job observed Complete: now the backend Deployment, with the
   `wait-for-weights` init container in front of the engine;
5. that init container's command, then a STAND-IN ENGINE (`demo/backend.py`) started the way the
   rendered Pod would start the engine: from NOCTAYA_MODEL_PATH, offline, reading the staged weights.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import requests

from demo.__main__ import ROOT, Processes, first_doc, free_port, say, sync_request
from demo.hub import FakeHub, HubRepo

EXAMPLE_MODEL = ROOT / "examples" / "models" / "sharedpvc-prewarm.yaml"
EXAMPLE_RUNTIME = ROOT / "examples" / "runtimes" / "llamacpp-cpu.yaml"


def demo_repo(size: int) -> tuple[str, HubRepo]:
    """A small "model" at two revisions of one repo: main, and the pinned revision the example asks for."""
    block = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(32 * 1024))  # 1 MiB
    weights = (block * (size // len(block) + 1))[:size]
    commit = hashlib.sha1(b"demo-main").hexdigest()
    files = {"config.json": b'{"model_type": "qwen2", "demo": true}', "model.safetensors": weights,
             "tokenizer.json": b'{"version": "1.0"}', "generation_config.json": b"{}"}
    return "Qwen/Qwen2.5-32B-Instruct", HubRepo({commit: files}, {"main": commit}, token=DEMO_TOKEN)


def component(answer: dict, kind: str, name: str) -> dict[str, Any] | None:
    for child in answer["children"]:
        if child["kind"] == kind and child["metadata"]["labels"].get("serving.noctaya.io/component") == name:
            return child
    return None


DEMO_TOKEN = "hf_demo_token_for_the_stand_in_hub"
SECRETS = {("hub-token", "token"): DEMO_TOKEN}  # STAND-IN for the Secret the kubelet would project


def local_command(container: dict[str, Any], cache_mount: str, cache_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The container's command and env, with the cache volume's mount path mapped to a local
    directory and secretKeyRef values from the stand-in Secret (what the kubelet does in a Pod)."""
    def local(value: str) -> str:
        return str(cache_dir) + value[len(cache_mount):] if value.startswith(cache_mount) else value

    command = [local(a) for a in container["command"]]
    assert command[:2] == ["python", "-m"], command
    env = {e["name"]: local(e["value"]) for e in container.get("env", []) if "value" in e}
    for e in container.get("env", []):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            env[e["name"]] = SECRETS[(ref["name"], ref["key"])]
    return [sys.executable, *command[1:]], env


def sync(hooks: str, service: dict, runtime: dict, observed: list[dict] | None = None,
         status: dict | None = None) -> dict:
    request = sync_request(service, runtime)
    if status is not None:
        request["parent"]["status"] = status
    for child in observed or []:
        group = f"{child['kind']}.{child['apiVersion']}"
        request["children"].setdefault(group, {})[child["metadata"]["name"]] = child
    resp = requests.post(f"{hooks}/v1/llmservice/sync", json=request, timeout=10)
    resp.raise_for_status()
    return resp.json()


def show(answer: dict) -> None:
    for child in answer["children"]:
        say("hooks", f"  child {child['kind']}/{child['metadata']['name']}")
    for cond in answer["status"]["conditions"]:
        if cond["type"] in ("CacheReady", "BackendReady", "Ready"):
            say("hooks", f"  condition {cond['type']}={cond['status']} ({cond['reason']}): {cond['message'][:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description="Local prewarm demo: a Job fills the cache, the backend starts from it.")
    parser.add_argument("--size-mib", type=float, default=24.0, help="size of the demo weights")
    parser.add_argument("--mib-per-second", type=float, default=8.0, help="the stand-in hub's bandwidth")
    args = parser.parse_args()

    service = first_doc(EXAMPLE_MODEL, "LLMService")
    runtime = first_doc(EXAMPLE_RUNTIME, "InferenceRuntime")
    service["spec"]["runtime"] = {"name": runtime["metadata"]["name"]}
    service["spec"]["resources"] = {"accelerators": 0}  # the CPU runtime of the demo
    service["spec"]["model"]["credentialsSecret"] = {"name": "hub-token"}  # a gated repo: the Job needs a token
    repo_id, repo = demo_repo(int(args.size_mib * 1024 * 1024))
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="noctaya-prewarm-demo-") as tmp, \
            FakeHub({repo_id: repo}, bytes_per_second=args.mib_per_second * 1024 * 1024) as hub:
        cache_dir = Path(tmp) / "cache"
        cache_dir.mkdir()
        try:
            say("hub", f"stand-in hub on {hub.url} holds {repo_id} ({args.size_mib:.0f} MiB at "
                f"{args.mib_per_second:.0f} MiB/s)")
            port = free_port()
            server = procs.start(["-m", "hooks", "serve", "--bind", f"127.0.0.1:{port}", "--workers", "1"])
            hooks = f"http://127.0.0.1:{port}"
            procs.wait_ready(server, f"{hooks}/healthz", timeout=30)
            say("hooks", f"POST /v1/llmservice/sync for {service['metadata']['name']} (cache.prewarm: true)")
            first = sync(hooks, service, runtime)
            show(first)
            job = component(first, "Job", "prewarm")
            if job is None or component(first, "Deployment", "backend") is not None:
                say("demo", "expected a prewarm Job and no backend yet")
                return 1
            container = job["spec"]["template"]["spec"]["containers"][0]
            cache_mount = container["command"][container["command"].index("--cache-dir") + 1]
            command, env = local_command(container, cache_mount, cache_dir)
            env.update(HF_ENDPOINT=hub.url, HF_HOME=str(Path(tmp) / "hf-home"), PATH=os.environ["PATH"],
                       PYTHONPATH=str(ROOT), NOCTAYA_TERMINATION_LOG=str(Path(tmp) / "termination-log"))
            command += ["--progress-interval", "1"]
            token_ref = next((e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "HF_TOKEN"), None)
            say("job", f"running the Job's command: {' '.join(container['command'][2:])} "
                f"(HF_TOKEN from Secret {token_ref['name'] if token_ref else '-'}, never in args)")
            job_proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
            assert job_proc.stdout is not None
            for line in job_proc.stdout:
                say("job", line.rstrip().split(" ", 3)[-1].replace(str(cache_dir), "<cache>"))
            if job_proc.wait(600) != 0:
                say("demo", "the prewarm Job failed")
                return 1
            markers = sorted(cache_dir.rglob("*.ready"))
            say("cache", f"marker {markers[0].relative_to(cache_dir)}: {markers[0].read_text().strip()}")

            observed = []
            for i, child in enumerate(first["children"]):
                seen = copy.deepcopy(child)
                seen["metadata"].update(uid=f"demo-{i}", annotations={
                    **seen["metadata"].get("annotations", {}),
                    "metacontroller.k8s.io/last-applied-configuration": json.dumps(child, sort_keys=True)})
                if child["kind"] == "Job":
                    seen["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
                observed.append(seen)
            say("hooks", "POST /v1/llmservice/sync again, the Job observed Complete")
            second = sync(hooks, service, runtime, observed, first["status"])
            show(second)
            backend = component(second, "Deployment", "backend")
            if backend is None:
                say("demo", "expected the backend once the Job completed")
                return 1
            pod = backend["spec"]["template"]["spec"]
            init = pod["initContainers"][0]
            # The marker wait is a shell loop in the engine's image: run it with this machine's sh,
            # the cache mount mapped to the local cache, at most 30 s.
            local = [str(cache_dir) + a[len(cache_mount):] if a.startswith(cache_mount + "/") else a
                     for a in init["command"]]
            say("pod", f"init container {init['name']} (image {init['image']}): waits for {init['command'][4]}")
            waited = subprocess.run([*local[:-1], "30"], cwd=ROOT, env={"PATH": os.environ["PATH"]},
                                    capture_output=True, text=True, timeout=60)
            for line in waited.stdout.splitlines():
                say("pod", "  " + line)
            if waited.returncode != 0:
                return 1
            engine_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert DEMO_TOKEN not in json.dumps(second) and "HF_TOKEN" not in engine_env
            model_path = str(cache_dir) + engine_env["NOCTAYA_MODEL_PATH"][len(cache_mount):]
            mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model-cache")
            say("pod", f"engine: NOCTAYA_MODEL_PATH={engine_env['NOCTAYA_MODEL_PATH']}, "
                f"HF_HUB_OFFLINE={engine_env.get('HF_HUB_OFFLINE')}, cache readOnly={mount.get('readOnly', False)}, "
                f"hub token in env: {'HF_TOKEN' in engine_env}")
            backend_port = free_port()
            engine = procs.start(["-m", "demo.backend", "--port", str(backend_port), "--model", "qwen-32b",
                                  "--load-seconds", "0.5", "--model-dir", model_path],
                                 env={"HF_HUB_OFFLINE": "1"})
            procs.wait_ready(engine, f"http://127.0.0.1:{backend_port}/health", timeout=60)
            loaded = next(line for line in procs.log_tail(engine).splitlines() if line.startswith("demo backend: "))
            say("engine", loaded.removeprefix("demo backend: ").replace(str(cache_dir), "<cache>"))
            listed = requests.get(f"http://127.0.0.1:{backend_port}/v1/models", timeout=5).json()["data"][0]
            say("engine", f"Ready; /v1/models → {listed['id']} from {listed['root'][len(str(cache_dir)):]} in the cache")
            say("demo", "the backend started from the prewarmed cache, offline, without the hub token")
            return 0
        finally:
            procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
