"""Stage an OCI artifact, pinned by its manifest digest, into the cache.

Transfer is the ORAS Python SDK (``oras``, in this image): it speaks the registry protocol, the token
and basic auth flows, and reads registry credentials from a Docker config file (the mounted
``kubernetes.io/dockerconfigjson`` Secret). Chosen over the ORAS CLI in a second container because
the same program then checks everything before a byte reaches the engine's directory, with one image
to pin. What the SDK's own ``pull`` does not do, this module does, and in this order:

1. fetch the manifest *by digest* and refuse it unless the bytes hash to that digest;
2. download each layer into ``<digest>.blobs`` (beside, never inside, what the engine reads) and
   refuse it unless its size and sha256 are what the manifest says;
3. place each layer into ``<digest>.partial`` under its ``org.opencontainers.image.title``: a plain
   file as is, a directory layer (``io.deis.oras.content.unpack``, a tar+gzip as ``oras push dir/``
   makes) by extracting regular files and directories only. A symbolic link, a hard link, a device or
   FIFO, an absolute path or one that escapes the target (``..``) fails the whole artifact;
4. promote ``.partial`` with one rename and write the marker (``prewarm.layout``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from prewarm.hub import HASH_CHUNK, PrewarmError, file_digest
from prewarm.layout import LayoutError, ModelDir, check_regular_tree, safe_relative_path
from prewarm.progress import Progress

log = logging.getLogger("noctaya.prewarm")

TITLE = "org.opencontainers.image.title"
UNPACK = "io.deis.oras.content.unpack"
DIR_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
MANIFEST_TYPES = ["application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"]
MAX_MANIFEST_BYTES = 4 << 20
MAX_LAYERS = 10_000


def _inside(root: Path, relative: PurePosixPath) -> Path:
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise PrewarmError(f"{relative} resolves outside the target directory: refused")
    return target


def extract_layer(archive: Path, root: Path, title: PurePosixPath) -> int:
    """Extract the directory layer titled ``title`` into ``root``: regular files and directories
    only, each under ``title`` (``oras push dir/`` archives the directory by its own name); anything
    else fails the artifact. Returns the number of files."""
    files = 0
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            if member.isdir() and PurePosixPath(member.name).parts in ((), (".",)):
                continue  # the archive's "./" entry
            name = safe_relative_path(member.name, "archive entry")
            if name != title and title not in name.parents:
                raise PrewarmError(f"archive entry {member.name!r} lies outside its layer's title {str(title)!r}: refused")
            if member.issym() or member.islnk():
                raise PrewarmError(f"archive entry {member.name!r} is a {'symbolic' if member.issym() else 'hard'} "
                                   "link: refused")
            if not (member.isfile() or member.isdir()):
                raise PrewarmError(f"archive entry {member.name!r} is a device, FIFO or other special file: refused")
            dest = _inside(root, name)
            if member.isdir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists() or dest.is_symlink():
                raise PrewarmError(f"archive entry {member.name!r} appears twice: refused")
            src = tar.extractfile(member)
            assert src is not None
            with src, open(dest, "xb") as out:
                shutil.copyfileobj(src, out, HASH_CHUNK)
            os.chmod(dest, 0o644)
            files += 1
    return files


class OciStager:
    def __init__(self, docker_config: str | None = None, plain_http: bool = False) -> None:
        import oras.provider

        self.registry = oras.provider.Registry(insecure=plain_http)
        self.docker_config = docker_config

    def manifest(self, model: ModelDir) -> dict[str, Any]:
        """The manifest, fetched by digest and refused unless its bytes hash to that digest."""
        reference = f"{model.repo_id}@{model.revision}"
        container = self.registry.get_container(reference)
        self.registry.auth.load_configs(container, configs=[self.docker_config] if self.docker_config else None)
        url = f"{self.registry.prefix}://{container.manifest_url()}"
        response = self.registry.do_request(url, "GET", headers={"Accept": ", ".join(MANIFEST_TYPES)})
        if response.status_code in (401, 403):
            raise PrewarmError(_auth_message(model, response.status_code))
        if response.status_code == 404:
            raise PrewarmError(f"{model.source}: the registry has no manifest with this digest (HTTP 404)")
        if response.status_code != 200:
            raise PrewarmError(f"{model.source}: the registry answered HTTP {response.status_code} for the manifest")
        body = response.content
        if len(body) > MAX_MANIFEST_BYTES:
            raise PrewarmError(f"{model.source}: the manifest is larger than {MAX_MANIFEST_BYTES} bytes: refused")
        got = "sha256:" + hashlib.sha256(body).hexdigest()
        if got != model.revision:
            raise PrewarmError(f"{model.source}: the registry served a manifest with digest {got}, not the pinned "
                               f"{model.revision}: refused")
        import json

        manifest = json.loads(body)
        layers = manifest.get("layers") if isinstance(manifest, dict) else None
        if not isinstance(layers, list) or not layers:
            raise PrewarmError(f"{model.source}: the manifest lists no layers (is it an artifact with files?)")
        if len(layers) > MAX_LAYERS:
            raise PrewarmError(f"{model.source}: more than {MAX_LAYERS} layers: refused")
        self._container = container
        return manifest

    def fetch(self, digest: str, size: int, out: Path) -> None:
        with self.registry.get_blob(self._container, digest, stream=True) as response:
            if response.status_code in (401, 403):
                raise PrewarmError(f"blob {digest}: the registry refused access (HTTP {response.status_code})")
            if response.status_code != 200:
                raise PrewarmError(f"blob {digest}: the registry answered HTTP {response.status_code}")
            with open(out, "wb") as fh:
                for chunk in response.iter_content(chunk_size=1 << 20):
                    fh.write(chunk)
        if out.stat().st_size != size:
            raise PrewarmError(f"blob {digest}: {out.stat().st_size} bytes arrived, the manifest says {size}: refused")
        if "sha256:" + file_digest(out, hashlib.sha256()) != digest:
            raise PrewarmError(f"blob {digest}: its content does not hash to its digest: refused")


def _auth_message(model: ModelDir, status: int) -> str:
    secret = os.environ.get("NOCTAYA_CREDENTIALS_SECRET", "").strip()
    if secret:
        return (f"{model.source}: the registry refused the credentials from Secret \"{secret}\" (HTTP {status}); "
                "check the kubernetes.io/dockerconfigjson Secret's server and password")
    return (f"{model.source}: the registry refused access (HTTP {status}) and no credentials were given: "
            "set model.credentialsSecret to a kubernetes.io/dockerconfigjson Secret")


def stage(model: ModelDir, stager: OciStager, progress_interval: float = 10.0) -> dict[str, object]:
    """Stage ``model`` (an oci:// source) in the cache; returns the marker. Idempotent."""
    existing = model.read_marker()
    if existing is not None:
        log.info("%s is already in the cache (%s files); nothing to do", model.source, existing.get("files"))
        return existing
    blobs = model.partial.with_name(model.partial.name.replace(".partial", ".blobs"))
    model.parent.mkdir(parents=True, exist_ok=True)
    if model.clear_partial():
        log.info("removed %s left by an interrupted attempt", model.partial.name)
    shutil.rmtree(blobs, ignore_errors=True)
    try:
        manifest = stager.manifest(model)
        layers = manifest["layers"]
        titles: set[PurePosixPath] = set()
        plan = []
        for layer in layers:
            digest, size = layer.get("digest"), layer.get("size")
            if not isinstance(digest, str) or not digest.startswith("sha256:") or not isinstance(size, int) or size < 0:
                raise PrewarmError(f"{model.source}: a layer without a sha256 digest and size: refused")
            title = (layer.get("annotations") or {}).get(TITLE)
            if not isinstance(title, str):
                raise PrewarmError(f"{model.source}: layer {digest} has no {TITLE} annotation (a file name): refused")
            name = safe_relative_path(title, "layer title")
            if name in titles:
                raise PrewarmError(f"{model.source}: two layers are titled {title!r}: refused")
            titles.add(name)
            # A directory layer: ORAS marks it with the unpack annotation (the Go CLI) or the tar+gzip
            # media type alone (oras-py); a file layer is its bytes as they are.
            unpack = (str((layer.get("annotations") or {}).get(UNPACK, "")).lower() == "true"
                      or layer.get("mediaType") == DIR_MEDIA_TYPE)
            plan.append((digest, size, name, unpack))
        total = sum(size for _, size, _, _ in plan)
        log.info("staging %s: %d layers, %s", model.source, len(plan), Progress.human(total))
        blobs.mkdir(parents=True)
        model.partial.mkdir(parents=True)
        with Progress(blobs, total, log, progress_interval):
            for digest, size, _, _ in plan:
                stager.fetch(digest, size, blobs / digest.replace(":", "-"))
        files = 0
        for digest, _, name, unpack in plan:
            blob = blobs / digest.replace(":", "-")
            target = _inside(model.partial, name)
            if unpack:
                files += extract_layer(blob, model.partial, name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(blob, target)
                os.chmod(target, 0o644)
                files += 1
        check_regular_tree(model.partial)
    except PrewarmError:
        raise
    except LayoutError as exc:
        raise PrewarmError(f"{model.source}: {exc}") from None
    except Exception as exc:  # network, registry protocol, a broken archive
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise PrewarmError(f"{model.source}: staging failed: {type(exc).__name__}: {first}") from None
    finally:
        shutil.rmtree(blobs, ignore_errors=True)
    marker = {"files": files, "bytes": total, "layers": len(plan)}
    model.promote(marker)
    log.info("promoted %s and wrote %s: %d files from %d layers", model.final, model.marker.name, files, len(plan))
    return {"source": model.source, "revision": model.revision, **marker}
