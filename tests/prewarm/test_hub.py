"""The downloader end to end: `python -m prewarm hub` with the hubs' real clients against a local
server speaking their protocols (HF_ENDPOINT / MODELSCOPE_ENDPOINT point the clients at it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from demo.hub import FakeHub
from prewarm.hub import HubClient, Listing, PrewarmError, RemoteFile, prewarm, verify
from prewarm.layout import LayoutError, ModelDir, revision_key
from prewarm.transfer import Limits
from tests.prewarm.conftest import MAIN, MAIN_FILES, SENTINEL, V1, V1_FILES, run_prewarm

SCHEMES = ["hf", "modelscope"]


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_complete_download_is_verified_promoted_and_marked(hub: FakeHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    run = run_prewarm(hub, tmp_path, "hub", "--source", f"{scheme}://org/model", "--cache-dir", str(cache),
                      "--progress-interval", "0.01", scheme=scheme)
    assert run.code == 0, run.out
    model = ModelDir.of(cache, f"{scheme}://org/model", None)
    assert tree(model.final) == MAIN_FILES  # exactly the listed files: no client bookkeeping left behind
    assert not model.partial.exists()
    marker = json.loads(model.marker.read_text())
    assert marker["source"] == f"{scheme}://org/model" and marker["revision"] == model.revision
    assert marker["files"] == 3 and marker["bytes"] == sum(len(v) for v in MAIN_FILES.values())
    if scheme == "hf":
        assert marker["resolved"] == MAIN
    assert "downloaded 293.0 KiB of 293.0 KiB (100%)" in run.out
    assert "promoted" in run.out
    # A second run (the Job re-created, a retry) finds the marker and downloads nothing.
    before = len(hub.requests)
    again = run_prewarm(hub, tmp_path, "hub", "--source", f"{scheme}://org/model", "--cache-dir", str(cache), scheme=scheme)
    assert again.code == 0 and "already in the cache" in again.out and len(hub.requests) == before


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_connection_dropped_mid_file_leaves_only_partial_and_the_next_attempt_succeeds(
        hub: FakeHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    args = ("hub", "--source", f"{scheme}://org/model", "--cache-dir", str(cache))
    hub.drops["model.safetensors"] = 1000  # more than any client retries within one attempt
    failed = run_prewarm(hub, tmp_path, *args, scheme=scheme)
    model = ModelDir.of(cache, f"{scheme}://org/model", None)
    assert failed.code == 1, failed.out
    assert model.partial.is_dir() and not model.final.exists() and not model.marker.exists()
    assert "Traceback" not in failed.out and "failed" in failed.termination
    hub.drops.clear()
    retried = run_prewarm(hub, tmp_path, *args, scheme=scheme)
    assert retried.code == 0, retried.out
    assert "interrupted attempt" in retried.out
    assert tree(model.final) == MAIN_FILES and model.read_marker() is not None and not model.partial.exists()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_pinned_revision_downloads_that_revisions_files(hub: FakeHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    run = run_prewarm(hub, tmp_path, "hub", "--source", f"{scheme}://org/model", "--revision", "v1",
                      "--cache-dir", str(cache), scheme=scheme)
    assert run.code == 0, run.out
    model = ModelDir.of(cache, f"{scheme}://org/model", "v1")
    assert tree(model.final) == V1_FILES
    assert json.loads(model.marker.read_text())["revision"] == "v1"
    # main was not fetched: no file of main's was asked for.
    assert not any("model.safetensors" in r for r in hub.requests)
    assert not ModelDir.of(cache, f"{scheme}://org/model", None).final.exists()
    if scheme == "hf":
        assert json.loads(model.marker.read_text())["resolved"] == V1
        assert all(MAIN not in r for r in hub.requests)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_wrong_token_is_a_clear_error_naming_the_secret(hub: FakeHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    args = ("hub", "--source", f"{scheme}://org/private", "--cache-dir", str(cache))
    wrong = "hf_WRONG_s3ntinel_token_42"
    run = run_prewarm(hub, tmp_path, *args, token=wrong, secret="qwen-hub-token", scheme=scheme)
    assert run.code == 1
    assert 'refused the token from Secret "qwen-hub-token"' in run.out
    assert 'Secret "qwen-hub-token"' in run.termination
    assert "Traceback" not in run.out and wrong not in run.out + run.termination
    assert not ModelDir.of(cache, f"{scheme}://org/private", None).marker.exists()
    anonymous = run_prewarm(hub, tmp_path, *args, scheme=scheme)
    assert anonymous.code == 1 and "no token was given" in anonymous.out and "model.credentialsSecret" in anonymous.out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_token_never_reaches_logs_errors_or_the_cache(hub: FakeHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    hub.drops["model.safetensors"] = 1  # one retry's worth of trouble, logged
    run = run_prewarm(hub, tmp_path, "hub", "--source", f"{scheme}://org/private", "--cache-dir", str(cache),
                      "--progress-interval", "0.01", token=SENTINEL, secret="qwen-hub-token", scheme=scheme)
    assert run.code == 0, run.out
    assert SENTINEL not in run.out + run.termination
    model = ModelDir.of(cache, f"{scheme}://org/private", None)
    for path in cache.rglob("*"):
        if path.is_file():
            assert SENTINEL.encode() not in path.read_bytes(), path
    assert tree(model.final) == MAIN_FILES


def test_a_file_that_does_not_match_the_listing_is_never_promoted(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    repo = hub.repos["org/model"]
    listed = dict(repo.commits[MAIN])
    # The hub serves other bytes of the same length for one file than its listing hashes.
    hub.tamper["tokenizer/tokenizer.json"] = b'{"version": "6.6"}'
    run = run_prewarm(hub, tmp_path, "hub", "--source", "hf://org/model", "--cache-dir", str(cache))
    assert run.code == 1 and "tokenizer/tokenizer.json" in run.out, run.out
    model = ModelDir.of(cache, "hf://org/model", None)
    assert not model.marker.exists() and not model.final.exists()
    assert repo.commits[MAIN] == listed


def test_verify_checks_presence_size_and_hashes(tmp_path: Path) -> None:
    import hashlib

    (tmp_path / "a").write_bytes(b"hello")
    (tmp_path / "b").write_bytes(b"world!")
    ok = Listing(None, (RemoteFile("a", 5, sha256=hashlib.sha256(b"hello").hexdigest()),
                        RemoteFile("b", 6, git_blob=hashlib.sha1(b"blob 6\0world!").hexdigest())))
    verify(tmp_path, ok)
    for bad, fragment in [
        (RemoteFile("missing", 1), "not downloaded"),
        (RemoteFile("a", 4), "5 bytes on disk"),
        (RemoteFile("a", 5, sha256="0" * 64), "sha256"),
        (RemoteFile("b", 6, git_blob="0" * 40), "git blob id"),
    ]:
        with pytest.raises(PrewarmError, match=fragment):
            verify(tmp_path, Listing(None, (bad,)))


@pytest.mark.parametrize("revision, key", [("main", "main"), ("refs/pr/1", "refs--pr--1"), (".hidden", "_.hidden"),
                                           ("..", "_..")])
def test_revision_keys_are_one_safe_path_component(revision: str, key: str) -> None:
    assert revision_key(revision) == key


@pytest.mark.parametrize("source", ["hf://org", "hf://../x", "s3://org/m", "hf://org/m/extra", "hf://org/.."])
def test_sources_that_cannot_name_a_directory_are_refused(source: str, tmp_path: Path) -> None:
    with pytest.raises(LayoutError):
        ModelDir.of(tmp_path, source, None)


class _ListingOnly(HubClient):
    """A hub client whose listing is whatever the test says (a hostile or broken hub)."""

    scheme = "hf"

    def __init__(self, files: tuple[RemoteFile, ...], write: dict[str, bytes] | None = None) -> None:
        self.files, self.write = files, write or {}
        self.downloads = 0

    def listing(self, repo_id: str, revision: str) -> Listing:
        return Listing("c" * 40, self.files)

    def download(self, repo_id: str, revision: str, target: Path, listing: Listing, limits: Limits) -> None:
        self.downloads += 1
        for name, data in self.write.items():
            if name == "link":
                (target / name).symlink_to("/etc/passwd")
            else:
                (target / name).write_bytes(data)

    def auth_failure(self, exc: BaseException) -> str | None:
        return None


@pytest.mark.parametrize("path", ["../escape.bin", "/etc/escape.bin", "a/../../escape.bin"])
def test_a_listing_naming_a_path_outside_the_target_is_refused_before_any_download(tmp_path: Path, path: str) -> None:
    client = _ListingOnly((RemoteFile(path, 1),))
    model = ModelDir.of(tmp_path, "hf://org/model", None)
    with pytest.raises(PrewarmError, match="refused"):
        prewarm(model, client)
    assert client.downloads == 0 and not model.marker.exists()


def test_a_symlink_left_by_the_client_is_never_promoted(tmp_path: Path) -> None:
    import hashlib

    data = b"weights"
    client = _ListingOnly((RemoteFile("w.bin", len(data), sha256=hashlib.sha256(data).hexdigest()),),
                          {"w.bin": data, "link": b""})
    model = ModelDir.of(tmp_path, "hf://org/model", None)
    with pytest.raises(PrewarmError, match="not a regular file"):
        prewarm(model, client)
    assert not model.marker.exists() and not model.final.exists()
