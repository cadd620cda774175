"""`python -m hooks` as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, cwd: Path = ROOT, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "hooks", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "command", [[], ["serve"], ["render"], ["crds"]], ids=["top", "serve", "render", "crds"]
)
def test_help(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m hooks" in result.stdout


def test_no_command_is_usage_error() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage:" in result.stderr


# ------------------------------------------------------------------------------------------ render


def test_render_invalid_yaml_names_the_file_and_exits_2(tmp_path: Path) -> None:
    good = tmp_path / "a-good.yaml"
    good.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    bad = tmp_path / "b-broken.yaml"
    bad.write_text("apiVersion: v1\nkind: [unclosed\nmetadata: {name: y}\n")
    result = run_cli("render", str(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert str(bad) in result.stderr
    assert "invalid YAML (line" in result.stderr
    assert "Traceback" not in result.stderr


def test_render_rejects_non_object_documents(tmp_path: Path) -> None:
    listy = tmp_path / "list.yaml"
    listy.write_text("---\n- just\n- a list\n")
    result = run_cli("render", str(listy))
    assert result.returncode == 2
    assert f"{listy}: document 1 is a list" in result.stderr


def test_render_missing_path_and_empty_inputs(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = run_cli("render", str(missing))
    assert result.returncode == 2 and f"{missing}: no such file or directory" in result.stderr
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    result = run_cli("render", str(empty_dir))
    assert result.returncode == 2 and "contains no .yaml" in result.stderr
    only_comments = tmp_path / "comments.yaml"
    only_comments.write_text("# nothing here\n---\n")
    result = run_cli("render", str(only_comments))
    assert result.returncode == 2 and "no documents" in result.stderr


# -------------------------------------------------------------------------------------------- crds


def test_crds_check_passes_on_committed_crds() -> None:
    result = run_cli("crds", "--out", "crds", "--check")
    assert result.returncode == 0, result.stderr


def test_crds_check_detects_edited_missing_and_stale_files(tmp_path: Path) -> None:
    out = tmp_path / "crds"
    shutil.copytree(ROOT / "crds", out)
    edited = out / "serving.noctaya.io_llmservices.yaml"
    edited.write_text(edited.read_text() + "# hand edit\n")
    (out / "serving.noctaya.io_inferenceruntimes.yaml").unlink()
    (out / "old.example.com_gone.yaml").write_text(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n"
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    result = run_cli("crds", "--out", str(out), "--check")
    assert result.returncode == 1
    assert f"{edited}: differs" in result.stderr
    assert "serving.noctaya.io_inferenceruntimes.yaml: missing" in result.stderr
    assert "old.example.com_gone.yaml: CRD no longer generated" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # --check writes nothing


def test_crds_writes_files_identical_to_committed(tmp_path: Path) -> None:
    out = tmp_path / "fresh"
    result = run_cli("crds", "--out", str(out))
    assert result.returncode == 0, result.stderr
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(p.name for p in (ROOT / "crds").iterdir() if p.suffix == ".yaml")
    for name in written:
        assert (out / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name
    assert run_cli("crds", "--out", str(out), "--check").returncode == 0


# --------------------------------------------------------------------------- render with the real hooks


def test_render_example_llmservice_prints_its_children(tmp_path: Path) -> None:
    manifest = tmp_path / "qwen.yaml"
    manifest.write_text(
        yaml.safe_dump_all(
            [
                {
                    "apiVersion": "serving.noctaya.io/v1alpha1",
                    "kind": "InferenceRuntime",
                    "metadata": {"name": "llama-cpp-cpu"},
                    "spec": {"engine": "llamacpp", "image": "ghcr.io/ggml-org/llama.cpp:server"},
                },
                {
                    "apiVersion": "serving.noctaya.io/v1alpha1",
                    "kind": "LLMService",
                    "metadata": {"name": "qwen", "namespace": "models"},
                    "spec": {
                        "model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
                        "runtime": {"name": "llama-cpp-cpu"},
                    },
                },
            ]
        )
    )
    result = run_cli("render", str(manifest))
    assert result.returncode == 0, result.stderr
    rendered = list(yaml.safe_load_all(result.stdout))
    assert rendered and all(isinstance(doc, dict) and doc.get("kind") for doc in rendered)
    assert any(doc["kind"] == "Deployment" for doc in rendered)


def test_render_invalid_spec_names_the_file_of_the_object(tmp_path: Path) -> None:
    runtimes = tmp_path / "runtimes.yaml"
    shutil.copy(ROOT / "examples" / "runtimes" / "vllm-nvidia.yaml", runtimes)
    service = tmp_path / "bad-service.yaml"
    service.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "serving.noctaya.io/v1alpha1",
                "kind": "LLMService",
                "metadata": {"name": "broken", "namespace": "models"},
                "spec": {"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "scaling": {"max": 0}},
            }
        )
    )
    result = run_cli("render", str(runtimes), str(service))
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"{service}: LLMService models/broken" in result.stderr
    assert "Traceback" not in result.stderr


def test_render_examples_directories_like_make_render(tmp_path: Path) -> None:
    # Generated per-service tokens derive from the token key, random per process unless fixed.
    key_file = tmp_path / "token-key"
    key_file.write_bytes(b"render-test-token-key-0123456789")
    env = {"NOCTAYA_TOKEN_KEY_FILE": str(key_file)}
    result = run_cli("render", "examples/runtimes", "examples/models", "examples/gateways", env_extra=env)
    assert result.returncode == 0, result.stderr
    rendered = list(yaml.safe_load_all(result.stdout))
    kinds = {doc["kind"] for doc in rendered}
    assert {"Deployment", "Service", "ScaledObject"} <= kinds
    assert all(doc["metadata"].get("name") for doc in rendered)
    # Offline rendering is deterministic: a second run prints the same bytes.
    assert run_cli("render", "examples/runtimes", "examples/models", "examples/gateways", env_extra=env).stdout == result.stdout
