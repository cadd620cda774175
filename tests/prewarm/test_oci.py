"""OCI staging against a real registry on 127.0.0.1 (Debian's docker-registry), holding artifacts the
tests push with the same ORAS client the Job uses: correct files promoted; links, special files and
paths escaping the target refused with no marker; a manifest or blob that does not match its digest
refused (served through a tampering proxy in front of the real registry)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from prewarm.hub import PrewarmError
from prewarm.layout import ModelDir
from prewarm.oci import OciStager, stage
from prewarm.transfer import Limits
from tests.prewarm.registry import registry  # noqa: F401 - the session fixture

pytest.importorskip("oras")

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = {"config.json": b'{"model_type": "granite"}', "model.safetensors": os.urandom(64 * 1024),
           "tokenizer/tokenizer.json": b'{"v": 1}'}


def manifest_digest(address: str, repo: str, tag: str) -> str:
    r = requests.get(f"http://{address}/v2/{repo}/manifests/{tag}", timeout=10,
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    r.raise_for_status()
    return "sha256:" + hashlib.sha256(r.content).hexdigest()


def push_with_oras(address: str, repo: str, tag: str, workdir: Path) -> str:
    """`oras push` of a directory and a file, as a user publishing weights would."""
    import oras.client

    weights = workdir / "weights"
    for name, data in WEIGHTS.items():
        (weights / name).parent.mkdir(parents=True, exist_ok=True)
        (weights / name).write_bytes(data)
    (workdir / "README.md").write_text("granite weights\n")
    client = oras.client.OrasClient(hostname=address, insecure=True)
    cwd = os.getcwd()
    os.chdir(workdir)  # ORAS titles layers by the names given, relative to here
    try:
        client.push(target=f"{address}/{repo}:{tag}", files=["weights", "README.md"])
    finally:
        os.chdir(cwd)
    return manifest_digest(address, repo, tag)


def push_layers(address: str, repo: str, tag: str, workdir: Path, layers: list[tuple[bytes, str, dict]]) -> str:
    """An artifact put together layer by layer with the ORAS SDK (for the hostile ones)."""
    import oras.oci
    import oras.provider

    reg = oras.provider.Registry(insecure=True)
    container = reg.get_container(f"{address}/{repo}:{tag}")
    manifest = oras.oci.NewManifest()
    for i, (data, media_type, notes) in enumerate(layers):
        blob = workdir / f"layer-{i}"
        blob.write_bytes(data)
        layer = oras.oci.NewLayer(str(blob), media_type=media_type)
        layer["annotations"] = notes
        reg.upload_blob(str(blob), container, layer).raise_for_status()
        manifest["layers"].append(layer)
    conf, _ = oras.oci.ManifestConfig()  # the empty config "{}"
    empty = workdir / "config.json"
    empty.write_text("{}")
    reg.upload_blob(str(empty), container, conf).raise_for_status()
    manifest["config"] = conf
    reg.upload_manifest(manifest, container).raise_for_status()
    return manifest_digest(address, repo, tag)


def tar_gz(add: Callable[[tarfile.TarFile], None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        add(tar)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", link: str = "") -> Callable[[tarfile.TarFile], None]:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = link
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return add


def both(*adds: Callable[[tarfile.TarFile], None]) -> Callable[[tarfile.TarFile], None]:
    return lambda tar: [a(tar) for a in adds]


DIR = "application/vnd.oci.image.layer.v1.tar+gzip"
FILE = "application/vnd.oci.image.layer.v1.tar"
TITLE = "org.opencontainers.image.title"


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prewarm", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": "/nonexistent", **(env or {})})


def test_an_artifact_pushed_with_oras_is_staged_verified_and_marked(registry: str, tmp_path: Path) -> None:  # noqa: F811
    digest = push_with_oras(registry, "models/granite", "v1", tmp_path)
    cache = tmp_path / "cache"
    source = f"oci://{registry}/models/granite@{digest}"
    term = tmp_path / "termination"
    done = run_cli("oci", "--source", source, "--cache-dir", str(cache), "--plain-http", "--progress-interval", "0.01",
                   env={"NOCTAYA_TERMINATION_LOG": str(term)})
    assert done.returncode == 0, done.stdout + done.stderr
    model = ModelDir.of(cache, source, None)
    assert model.final.name == "sha256-" + digest.split(":")[1]
    assert tree(model.final) == {**{f"weights/{k}": v for k, v in WEIGHTS.items()}, "README.md": b"granite weights\n"}
    marker = json.loads(model.marker.read_text())
    assert marker["source"] == source and marker["revision"] == digest and marker["files"] == 4 and marker["layers"] == 2
    assert not model.partial.exists() and not list(model.parent.glob("*.blobs"))
    assert "promoted" in done.stdout and "downloaded" in done.stdout
    again = run_cli("oci", "--source", source, "--cache-dir", str(cache), "--plain-http")
    assert again.returncode == 0 and "already in the cache" in again.stdout
    # The init container waits for exactly this marker.
    waited = run_cli("wait", "--source", source, "--cache-dir", str(cache), "--timeout", "5")
    assert waited.returncode == 0, waited.stdout + waited.stderr


HOSTILE = {
    "symlink": [(tar_gz(both(member("weights/"), member("weights/evil", tarfile.SYMTYPE, link="/etc/passwd"))), DIR,
                 {TITLE: "weights"})],
    "hard link": [(tar_gz(both(member("weights/a"), member("weights/b", tarfile.LNKTYPE, link="weights/a"))), DIR,
                   {TITLE: "weights"})],
    "device": [(tar_gz(member("weights/null", tarfile.CHRTYPE)), DIR, {TITLE: "weights"})],
    "fifo": [(tar_gz(member("weights/pipe", tarfile.FIFOTYPE)), DIR, {TITLE: "weights"})],
    "dot-dot in the archive": [(tar_gz(member("weights/../../escape")), DIR, {TITLE: "weights"})],
    "absolute in the archive": [(tar_gz(member("/tmp/escape")), DIR, {TITLE: "weights"})],
    "outside its title": [(tar_gz(member("other/file")), DIR, {TITLE: "weights"})],
    "dot-dot title": [(b"data", FILE, {TITLE: "../escape.bin"})],
    "absolute title": [(b"data", FILE, {TITLE: "/etc/escape.bin"})],
    "no title": [(b"data", FILE, {})],
    "duplicate title": [(b"a", FILE, {TITLE: "x.bin"}), (b"b", FILE, {TITLE: "x.bin"})],
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_artifacts_are_refused_without_a_marker(registry: str, tmp_path: Path, case: str) -> None:  # noqa: F811
    repo = "hostile/" + case.replace(" ", "-")
    digest = push_layers(registry, repo, "v1", tmp_path, HOSTILE[case])
    cache = tmp_path / "cache"
    model = ModelDir.of(cache, f"oci://{registry}/{repo}@{digest}", None)
    with pytest.raises(PrewarmError, match="refused"):
        stage(model, OciStager(plain_http=True), progress_interval=60)
    assert not model.marker.exists() and not model.final.exists()
    assert not list(model.parent.glob("*.blobs"))
    escaped = [p for p in (tmp_path / "escape", tmp_path.parent / "escape", Path("/tmp/escape")) if p.exists()]
    assert escaped == [] and not Path("/etc/escape.bin").exists()


def test_the_command_refuses_a_symlink_with_exit_1_and_says_why(registry: str, tmp_path: Path) -> None:  # noqa: F811
    digest = push_layers(registry, "hostile/cli", "v1", tmp_path, HOSTILE["symlink"])
    term = tmp_path / "termination"
    source = f"oci://{registry}/hostile/cli@{digest}"
    done = run_cli("oci", "--source", source, "--cache-dir", str(tmp_path / "cache"), "--plain-http",
                   env={"NOCTAYA_TERMINATION_LOG": str(term)})
    assert done.returncode == 1 and "symbolic link: refused" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert "symbolic link: refused" in term.read_text()


def test_a_digest_the_registry_does_not_have_is_refused(registry: str, tmp_path: Path) -> None:  # noqa: F811
    push_with_oras(registry, "models/granite", "v1", tmp_path)
    model = ModelDir.of(tmp_path / "cache", f"oci://{registry}/models/granite@sha256:{'0' * 64}", None)
    with pytest.raises(PrewarmError, match="no manifest with this digest"):
        stage(model, OciStager(plain_http=True))
    assert not model.marker.exists()


class RegistryProxy:
    """A local server in front of the real registry, on threads of its own: each GET is fetched from
    the registry and handed to ``serve``, which says what reaches the stager instead."""

    def __init__(self, upstream: str, protocol: str = "HTTP/1.0") -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = protocol

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                r = requests.get(f"http://{upstream}{self.path}", headers={"Accept": self.headers.get("Accept", "*/*")},
                                 timeout=10)
                outer.serve(self, r)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.server.server_port}"

    def serve(self, handler: BaseHTTPRequestHandler, r: requests.Response) -> None:
        raise NotImplementedError

    @staticmethod
    def send_head(handler: BaseHTTPRequestHandler, r: requests.Response, length: int | None) -> None:
        """The registry's status and content type; a Content-Length of ``length`` unless None."""
        handler.send_response(r.status_code)
        handler.send_header("Content-Type", r.headers.get("Content-Type", "application/octet-stream"))
        if length is not None:
            handler.send_header("Content-Length", str(length))
        handler.end_headers()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TamperingProxy(RegistryProxy):
    """Forwards to the real registry, changing what it serves: the manifest or a blob."""

    def __init__(self, upstream: str, tamper: Callable[[str, bytes], bytes]) -> None:
        self.tamper = tamper
        super().__init__(upstream)

    def serve(self, handler: BaseHTTPRequestHandler, r: requests.Response) -> None:
        body = self.tamper(handler.path, r.content) if r.status_code == 200 else r.content
        self.send_head(handler, r, len(body))
        handler.wfile.write(body)


@pytest.fixture
def proxy(registry: str) -> Iterator[Callable[[Callable[[str, bytes], bytes]], TamperingProxy]]:  # noqa: F811
    made: list[TamperingProxy] = []

    def make(tamper: Callable[[str, bytes], bytes]) -> TamperingProxy:
        made.append(TamperingProxy(registry, tamper))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_manifest_that_does_not_match_the_pinned_digest_is_refused(registry: str, proxy, tmp_path: Path) -> None:  # noqa: F811
    digest = push_with_oras(registry, "models/granite", "v1", tmp_path)
    mitm = proxy(lambda path, body: body + b" " if "/manifests/" in path else body)
    model = ModelDir.of(tmp_path / "cache", f"oci://{mitm.address}/models/granite@{digest}", None)
    with pytest.raises(PrewarmError, match="not the pinned"):
        stage(model, OciStager(plain_http=True))
    assert not model.marker.exists() and not model.final.exists()


def test_a_blob_that_does_not_match_its_digest_is_refused(registry: str, proxy, tmp_path: Path) -> None:  # noqa: F811
    digest = push_with_oras(registry, "models/granite", "v1", tmp_path)

    def flip(path: str, body: bytes) -> bytes:
        return body[:-1] + bytes([body[-1] ^ 1]) if "/blobs/" in path and len(body) > 100 else body

    mitm = proxy(flip)
    model = ModelDir.of(tmp_path / "cache", f"oci://{mitm.address}/models/granite@{digest}", None)
    with pytest.raises(PrewarmError, match="does not hash to its digest"):
        stage(model, OciStager(plain_http=True))
    assert not model.marker.exists() and not model.final.exists()


def test_a_missing_registry_secret_ends_the_job_naming_it(tmp_path: Path) -> None:
    term = tmp_path / "termination"
    done = run_cli("oci", "--source", f"oci://registry.example.com/m@sha256:{'1' * 64}", "--cache-dir", str(tmp_path),
                   env={"NOCTAYA_TERMINATION_LOG": str(term), "NOCTAYA_CREDENTIALS_SECRET": "model-registry",
                        "NOCTAYA_REGISTRY_CONFIG_FILE": str(tmp_path / "absent" / "config.json")})
    assert done.returncode == 3
    assert term.read_text().startswith('Secret "model-registry" not found')


# --- one fetch per blob, bounded sizes (#20, item 2) ----------------------------------------------

SHARED = b'{"shared": true}'


def test_identical_files_and_nested_folders_stage_with_each_blob_fetched_once(registry: str, proxy,  # noqa: F811
                                                                               tmp_path: Path) -> None:
    # What `oras push` makes of two empty files, a config.json shared by two folders and a directory.
    d = tarfile.DIRTYPE
    nested = tar_gz(both(member("deep/", d), member("deep/a/", d), member("deep/a/b/", d), member("deep/a/b/w.bin", data=b"w" * 999),
                         member("deep/a/config.json", data=SHARED)))
    layers = [(b"", FILE, {TITLE: "empty-1"}), (b"", FILE, {TITLE: "empty-2"}),
              (SHARED, FILE, {TITLE: "one/config.json"}), (SHARED, FILE, {TITLE: "two/sub/config.json"}),
              (nested, DIR, {TITLE: "deep"})]
    digest = push_layers(registry, "models/dupes", "v1", tmp_path, layers)
    fetched: list[str] = []
    counting = proxy(lambda path, body: (fetched.append(path) if "/blobs/" in path else None, body)[1])
    source = f"oci://{counting.address}/models/dupes@{digest}"
    model = ModelDir.of(tmp_path / "cache", source, None)
    marker = stage(model, OciStager(plain_http=True), progress_interval=60)
    assert tree(model.final) == {"empty-1": b"", "empty-2": b"", "one/config.json": SHARED,
                                 "two/sub/config.json": SHARED, "deep/a/b/w.bin": b"w" * 999, "deep/a/config.json": SHARED}
    assert marker["files"] == 6 and marker["layers"] == 5
    assert len(fetched) == len(set(fetched)) == 3, fetched  # the empty blob, the shared config, the archive
    assert not model.blobs.exists() and not model.partial.exists()
    assert {oct(p.stat().st_mode & 0o777) for p in model.final.rglob("*") if p.is_file()} == {"0o644"}


class OversizeProxy(RegistryProxy):
    """Serves one blob with more bytes than the manifest declares: with a Content-Length saying so,
    or without one (a close-delimited HTTP/1.0 body, so only counting the stream can stop it)."""

    def __init__(self, upstream: str, extra: int, announce: bool) -> None:
        self.extra, self.announce = extra, announce
        super().__init__(upstream, "HTTP/1.1" if announce else "HTTP/1.0")

    def serve(self, handler: BaseHTTPRequestHandler, r: requests.Response) -> None:
        body, extra = r.content, self.extra
        big = "/blobs/" in handler.path and r.status_code == 200 and len(body) > 1000
        announced = len(body) + (extra if big else 0) if self.announce or not big else None  # None: close-delimited
        self.send_head(handler, r, announced)
        handler.wfile.write(body)
        if big:
            try:
                for _ in range(extra // 65536):
                    handler.wfile.write(b"\0" * 65536)
            except OSError:
                pass  # the stager hung up: what this test wants


@pytest.mark.parametrize("announce", [True, False], ids=["content-length", "close-delimited"])
def test_a_blob_stream_longer_than_declared_is_refused(registry: str, tmp_path: Path, announce: bool) -> None:  # noqa: F811
    digest = push_with_oras(registry, "models/granite", "v1", tmp_path)
    extra = 256 << 20
    big = OversizeProxy(registry, extra, announce)
    try:
        model = ModelDir.of(tmp_path / "cache", f"oci://{big.address}/models/granite@{digest}", None)
        with pytest.raises(PrewarmError, match="announces|sent more than"):
            stage(model, OciStager(plain_http=True), progress_interval=60)
        assert not model.marker.exists() and not model.blobs.exists()
    finally:
        big.close()


class TrickleProxy(RegistryProxy):
    """Serves the registry's answers, but blobs larger than 1000 bytes at ``rate`` bytes per second."""

    def __init__(self, upstream: str, rate: float) -> None:
        self.rate = rate
        super().__init__(upstream, "HTTP/1.1")

    def serve(self, handler: BaseHTTPRequestHandler, r: requests.Response) -> None:
        body = r.content
        slow = "/blobs/" in handler.path and r.status_code == 200 and len(body) > 1000
        self.send_head(handler, r, len(body))
        try:
            for i in range(0, len(body), 64 if slow else len(body) or 1):
                handler.wfile.write(body[i:i + (64 if slow else len(body))])
                handler.wfile.flush()
                if slow:
                    time.sleep(64 / self.rate)
        except OSError:
            handler.close_connection = True  # the stager hung up: what this test wants


def test_a_blob_trickling_below_the_minimum_rate_is_abandoned_and_frees_the_lock(
        registry: str, tmp_path: Path) -> None:  # noqa: F811
    import logging

    digest = push_with_oras(registry, "models/granite", "v1", tmp_path)
    slow = TrickleProxy(registry, rate=256)  # the 64 KiB safetensors blob: 4 minutes
    try:
        model = ModelDir.of(tmp_path / "cache", f"oci://{slow.address}/models/granite@{digest}", None)
        started = time.monotonic()
        with pytest.raises(PrewarmError, match=r"blob sha256:[0-9a-f]{64}: stalled: .* below the minimum rate"):
            stage(model, OciStager(plain_http=True, limits=Limits(min_rate=1024, stall_window=1)),
                  progress_interval=60, lock_timeout=0)
        assert time.monotonic() - started < 15
        assert not model.marker.exists() and not model.blobs.exists() and not model.partial.exists()
        with model.locked(0, logging.getLogger("test")):  # free at once for the next attempt
            pass
    finally:
        slow.close()


def test_a_layer_that_expands_beyond_its_bound_is_refused(registry: str, tmp_path: Path) -> None:  # noqa: F811
    from prewarm import oci

    bomb = tar_gz(both(member("weights/", tarfile.DIRTYPE), member("weights/zeros.bin", data=b"\0" * (4 << 20))))
    assert len(bomb) * oci.MAX_EXPANSION < 4 << 20  # about 4 KiB of gzip for 4 MiB of zeros
    digest = push_layers(registry, "hostile/bomb", "v1", tmp_path, [(bomb, DIR, {TITLE: "weights"})])
    model = ModelDir.of(tmp_path / "cache", f"oci://{registry}/hostile/bomb@{digest}", None)
    with pytest.raises(PrewarmError, match="expands to more than"):
        stage(model, OciStager(plain_http=True), progress_interval=60)
    assert not model.marker.exists() and not model.final.exists() and not model.partial.exists()


def test_an_artifact_larger_than_the_free_space_is_refused_before_any_download(registry: str, tmp_path: Path,  # noqa: F811
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from prewarm import oci

    digest = push_with_oras(registry, "models/granite", "v1", tmp_path)
    monkeypatch.setattr(oci, "_free_bytes", lambda path: 1000)
    model = ModelDir.of(tmp_path / "cache", f"oci://{registry}/models/granite@{digest}", None)
    with pytest.raises(PrewarmError, match="the cache volume has 1000 B free: refused"):
        stage(model, OciStager(plain_http=True), progress_interval=60)
