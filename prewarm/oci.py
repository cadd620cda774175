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

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
import time
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import requests

from prewarm.hub import HASH_CHUNK, LOCK_TIMEOUT, SECRET_ENV, PrewarmError, staging_lock, without_queries
from prewarm.layout import LayoutError, ModelDir, check_regular_tree, safe_relative_path
from prewarm.progress import Progress
from prewarm.transfer import Limits, TransferError, stream_into

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


def extract_layer(archive: Path, root: Path, title: PurePosixPath, max_bytes: int | None = None) -> int:
    """Extract the directory layer titled ``title`` into ``root``: regular files and directories
    only, each under ``title`` (``oras push dir/`` archives the directory by its own name); anything
    else fails the artifact. At most ``max_bytes`` of file content and MAX_ARCHIVE_ENTRIES entries
    (a small gzip can expand a thousandfold and fill the cache volume). Returns the number of files."""
    files = entries = written = 0
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            entries += 1
            if entries > MAX_ARCHIVE_ENTRIES:
                raise PrewarmError(f"layer {str(title)!r} has more than {MAX_ARCHIVE_ENTRIES} entries: refused")
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
            written += member.size
            if max_bytes is not None and written > max_bytes:
                raise PrewarmError(f"layer {str(title)!r} expands to more than {max_bytes} bytes ({MAX_EXPANSION} times "
                                   "its declared size): refused")
            src = tar.extractfile(member)
            assert src is not None
            with src, open(dest, "xb") as out:
                shutil.copyfileobj(src, out, HASH_CHUNK)  # exactly member.size bytes: tarfile reads no more
            os.chmod(dest, 0o644)
            files += 1
    return files


NETWORK_ATTEMPTS = 3  # transient network errors only; the Job's own retries come on top
MAX_EXPANSION = 100  # a tar+gzip layer may expand to this many times its declared size (a bomb: 1000x)
MAX_ARCHIVE_ENTRIES = 200_000  # per directory layer (a model directory has tens of files)


class OciStager:
    """The registry conversation: the manifest by digest and each blob, with the auth flow the
    registry asks for. The ORAS SDK's default (token) flow treats a Basic challenge's realm as a URL
    and retries for minutes (SPEC appendix C); so the first answer's challenge picks the SDK's auth
    backend: ``basic`` for ``WWW-Authenticate: Basic``, ``token`` for ``Bearer`` (and no challenge).
    Requests go through the SDK's request-with-auth without its retry decorator (which retries a
    refused login five times over 131 s): network errors are retried a few times here, a refused
    login ends the attempt at once, naming the Secret."""

    def __init__(self, docker_config: str | None = None, plain_http: bool = False,
                 secret_name: str | None = None, limits: Limits | None = None) -> None:
        self.docker_config = docker_config
        self.limits = limits or Limits()
        self.plain_http = plain_http
        self.secret_name = secret_name if secret_name is not None else os.environ.get(SECRET_ENV, "").strip()
        self.prefix = "http" if plain_http else "https"
        self.registry: Any = None
        self.challenge = ""  # "basic", "bearer" or "" (none asked)
        self.has_credentials = False
        self._hosts_in_config: list[str] = []
        self._container: Any = None
        self._model: ModelDir | None = None

    # --- credentials -------------------------------------------------------------------------

    def _credentials(self, host: str) -> tuple[str, str] | None:
        """(username, password) for ``host`` from the Docker config file, or None. Keys may carry a
        scheme or a path (``https://host/v1/``); entries may give ``auth`` or username/password."""
        if not self.docker_config:
            return None
        try:
            with open(self.docker_config, "rb") as fh:
                config = json.loads(fh.read(1 << 20))
        except (OSError, ValueError) as exc:
            raise PrewarmError(f"{self._secret_words()} is not a readable Docker config JSON "
                               f"({type(exc).__name__}): use a kubernetes.io/dockerconfigjson Secret") from None
        auths = config.get("auths") if isinstance(config, dict) else None
        if not isinstance(auths, dict):
            auths = config if isinstance(config, dict) else {}  # the legacy .dockercfg shape
        self._hosts_in_config = sorted(_host_of(k) for k in auths)
        for key, entry in auths.items():
            if _host_of(key) != host or not isinstance(entry, dict):
                continue
            user, password = entry.get("username"), entry.get("password")
            if isinstance(user, str) and isinstance(password, str) and user:
                return user, password
            encoded = entry.get("auth")
            if isinstance(encoded, str) and encoded:
                try:
                    user, _, password = base64.b64decode(encoded).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    raise PrewarmError(f"{self._secret_words()}: the entry for {host} has an auth field that is "
                                       "not base64 of user:password") from None
                return user, password
        return None

    def _secret_words(self) -> str:
        return f'Secret "{self.secret_name}"' if self.secret_name else f"the Docker config {self.docker_config}"

    def auth_message(self, model: ModelDir, status: int | str) -> str:
        host = model.repo_id.split("/", 1)[0]
        said = f"HTTP {status}" if isinstance(status, int) else status
        if self.has_credentials:
            return (f"{model.source}: the registry refused the credentials for {host} from {self._secret_words()} "
                    f"({said}); check the username and password (or token) of the kubernetes.io/dockerconfigjson "
                    "Secret and that they may pull this repository")
        if self.docker_config:
            known = ", ".join(self._hosts_in_config) or "none"
            return (f"{model.source}: the registry asks for a login ({said}) but {self._secret_words()} has no "
                    f"credentials for {host} (it has: {known}); the Secret's server must be {host}")
        return (f"{model.source}: the registry refused access ({said}) and no credentials were given: "
                "set model.credentialsSecret to a kubernetes.io/dockerconfigjson Secret")

    # --- requests ----------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = requests.Session()
        plain = session.request

        def request(method: str, url: str, **kwargs: Any) -> requests.Response:
            kwargs.setdefault("timeout", self.limits.timeout)  # the SDK sets none: a stall would hang
            return plain(method, url, **kwargs)

        session.request = request  # type: ignore[method-assign]
        return session

    def _connect(self, model: ModelDir) -> None:
        """Pick the auth backend from the registry's challenge and give it the credentials."""
        import oras.provider

        host = model.repo_id.split("/", 1)[0]
        probe_session = self._session()
        url = f"{self.prefix}://{host}/v2/"
        response = self._with_network_retries(lambda: probe_session.get(url, stream=True))
        with response:
            header = response.headers.get("WWW-Authenticate", "") if response.status_code == 401 else ""
        probe_session.close()
        self.challenge = header.split(" ", 1)[0].strip().lower() if header else ""
        if self.challenge not in ("", "basic", "bearer"):
            raise PrewarmError(f"{model.source}: the registry asks for {header.split(' ', 1)[0]} authentication, "
                               "which is not supported (Basic and Bearer token are)")
        registry = oras.provider.Registry(insecure=self.plain_http,
                                          auth_backend="basic" if self.challenge == "basic" else "token")
        session = self._session()
        registry.session = session
        registry.auth.session = session
        creds = self._credentials(host)
        self.has_credentials = creds is not None
        if creds is not None:
            registry.auth.set_basic_auth(*creds)
        elif self.challenge == "basic":
            raise PrewarmError(self.auth_message(model, "a Basic login"))
        self.registry = registry
        self._container = registry.get_container(f"{model.repo_id}@{model.revision}")
        log.info("registry %s: %s", host, {"basic": "Basic login", "bearer": "token login"}.get(self.challenge, "no login asked")
                 + (f" with credentials from {self._secret_words()}" if creds and self.challenge else ""))

    def _with_network_retries(self, call: Any) -> requests.Response:
        for attempt in range(1, NETWORK_ATTEMPTS + 1):
            try:
                return call()
            except (requests.ConnectionError, requests.Timeout) as exc:
                if attempt == NETWORK_ATTEMPTS:
                    raise
                log.info("registry unreachable (%s), attempt %d of %d; retrying in %d s", type(exc).__name__, attempt,
                         NETWORK_ATTEMPTS, 2 ** attempt)
                time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def _get(self, model: ModelDir, url: str, headers: dict[str, str] | None = None) -> requests.Response:
        """GET with the registry's auth flow (streamed); a refused login raises PrewarmError."""
        import oras.provider

        do_request = oras.provider.Registry.do_request.__wrapped__  # the SDK's auth flow, not its retry loop

        def call() -> requests.Response:
            sent = dict(headers or {})
            if self.challenge == "basic":
                sent.update(self.registry.auth.get_auth_header())  # at once, not after a 401 for every blob
            try:
                return do_request(self.registry, url, "GET", headers=sent, stream=True)
            except ValueError as exc:  # "Cannot respond to request for authentication": no token was issued
                raise PrewarmError(self.auth_message(model, "the token service refused them"
                                                     if self.has_credentials else "no token issued")) from exc

        response = self._with_network_retries(call)
        if response.status_code == 401 and getattr(self.registry.auth, "token", None):
            response.close()  # a token that expired during a long download: ask for a new one, once
            self.registry.auth.token = None
            response = self._with_network_retries(call)
        if response.status_code in (401, 403):
            response.close()
            raise PrewarmError(self.auth_message(model, response.status_code))
        return response

    # --- the manifest and the blobs ----------------------------------------------------------

    def manifest(self, model: ModelDir) -> dict[str, Any]:
        """The manifest, fetched by digest and refused unless its bytes hash to that digest."""
        self._connect(model)
        url = f"{self.prefix}://{self._container.manifest_url()}"
        with self._get(model, url, {"Accept": ", ".join(MANIFEST_TYPES)}) as response:
            if response.status_code == 404:
                raise PrewarmError(f"{model.source}: the registry has no manifest with this digest (HTTP 404)")
            if response.status_code != 200:
                raise PrewarmError(f"{model.source}: the registry answered HTTP {response.status_code} for the manifest")
            body = response.raw.read(MAX_MANIFEST_BYTES + 1, decode_content=True)
        if len(body) > MAX_MANIFEST_BYTES:
            raise PrewarmError(f"{model.source}: the manifest is larger than {MAX_MANIFEST_BYTES} bytes: refused")
        got = "sha256:" + hashlib.sha256(body).hexdigest()
        if got != model.revision:
            raise PrewarmError(f"{model.source}: the registry served a manifest with digest {got}, not the pinned "
                               f"{model.revision}: refused")
        manifest = json.loads(body)
        layers = manifest.get("layers") if isinstance(manifest, dict) else None
        if not isinstance(layers, list) or not layers:
            raise PrewarmError(f"{model.source}: the manifest lists no layers (is it an artifact with files?)")
        if len(layers) > MAX_LAYERS:
            raise PrewarmError(f"{model.source}: more than {MAX_LAYERS} layers: refused")
        self._model = model
        return manifest

    def fetch(self, digest: str, size: int, out: Path) -> None:
        """Blob ``digest`` into ``out``: never more than the ``size`` bytes the manifest declares
        (checked before each chunk is written), abandoned below the minimum rate
        (``prewarm.transfer``), then its size and sha256 checked."""
        url = f"{self.prefix}://{self._container.get_blob_url(digest)}"
        assert self._model is not None, "manifest() first"
        with self._get(self._model, url) as response:
            if response.status_code != 200:
                raise PrewarmError(f"blob {digest}: the registry answered HTTP {response.status_code}")
            sink = _HashingFile(open(out, "xb"))
            try:
                with sink.fh:
                    got = stream_into(response, sink, size, self.limits, f"blob {digest}")
            except TransferError as exc:
                raise PrewarmError(str(exc)) from None
        if got != size:
            raise PrewarmError(f"blob {digest}: {got} bytes arrived, the manifest says {size}: refused")
        if "sha256:" + sink.sha256.hexdigest() != digest:
            raise PrewarmError(f"blob {digest}: its content does not hash to its digest: refused")


class _HashingFile:
    """A file that hashes what is written to it (the blob is checked without reading it again)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.sha256 = fh, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.fh.write(data)


def _host_of(key: str) -> str:
    """The registry host of a Docker config ``auths`` key (``https://host/v1/`` → ``host``)."""
    key = key.strip()
    for scheme in ("https://", "http://"):
        if key.startswith(scheme):
            key = key[len(scheme):]
    return key.split("/", 1)[0].lower()


def _place_file(blob: Path, target: Path) -> None:
    """A verified blob as the file ``target``: a hard link (no second copy of the bytes; the blob's
    name is removed with ``.blobs`` afterwards), a copy where the filesystem has no links."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        raise PrewarmError(f"{target.name} would be written twice: refused")
    try:
        os.link(blob, target)
    except OSError:
        shutil.copyfile(blob, target)
    os.chmod(target, 0o644)


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def stage(model: ModelDir, stager: OciStager, progress_interval: float = 10.0,
          lock_timeout: float = LOCK_TIMEOUT) -> dict[str, object]:
    """Stage ``model`` (an oci:// source) in the cache; returns the marker. Idempotent; one process
    at a time per artifact and cache (``ModelDir.locked``)."""
    with staging_lock(model, lock_timeout, progress_interval):
        return _stage(model, stager, progress_interval)


def _layer_plan(model: ModelDir, manifest: dict[str, Any]) -> tuple[list[tuple[str, int, PurePosixPath, bool]], dict[str, int]]:
    """Each layer as (digest, size, file name, unpack) and each distinct blob's size: every layer with a
    sha256 digest, a size and a safe title of its own, or the artifact is refused."""
    titles: set[PurePosixPath] = set()
    plan = []
    distinct: dict[str, int] = {}  # digest -> size: each blob is fetched once, whatever its titles
    for layer in manifest["layers"]:
        digest, size = layer.get("digest"), layer.get("size")
        if (not isinstance(digest, str) or not re.fullmatch(r"sha256:[a-f0-9]{64}", digest)
                or not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise PrewarmError(f"{model.source}: a layer without a sha256 digest and size: refused")
        if distinct.setdefault(digest, size) != size:
            raise PrewarmError(f"{model.source}: blob {digest} is declared with two sizes: refused")
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
    return plan, distinct


def _stage(model: ModelDir, stager: OciStager, progress_interval: float) -> dict[str, object]:
    existing = model.read_marker()
    if existing is not None:
        log.info("%s is already in the cache (%s files); nothing to do", model.source, existing.get("files"))
        return existing
    blobs = model.blobs
    model.parent.mkdir(parents=True, exist_ok=True)
    if model.clear_partial():
        log.info("removed %s left by an interrupted attempt", model.partial.name)
    shutil.rmtree(blobs, ignore_errors=True)
    try:
        manifest = stager.manifest(model)
        plan, distinct = _layer_plan(model, manifest)
        total = sum(distinct.values())
        free = _free_bytes(model.parent)
        if total > free:
            raise PrewarmError(f"{model.source}: the artifact's blobs are {Progress.human(total)}, the cache volume has "
                               f"{Progress.human(free)} free: refused (make the cache larger or remove old revisions)")
        shared = len(plan) - len(distinct)
        log.info("staging %s: %d layers, %d distinct blobs%s, %s", model.source, len(plan), len(distinct),
                 f" ({shared} titles share a blob with another)" if shared else "", Progress.human(total))
        blobs.mkdir(parents=True)
        model.partial.mkdir(parents=True)
        with Progress(blobs, total, log, progress_interval):
            for digest, size in distinct.items():
                stager.fetch(digest, size, blobs / digest.replace(":", "-"))
        files = 0
        for digest, size, name, unpack in plan:
            blob = blobs / digest.replace(":", "-")
            target = _inside(model.partial, name)
            if unpack:
                files += extract_layer(blob, model.partial, name, max_bytes=_expansion_limit(size))
            else:
                _place_file(blob, target)
                files += 1
        check_regular_tree(model.partial)
    except BaseException as exc:
        shutil.rmtree(model.partial, ignore_errors=True)  # a refused artifact leaves no bytes on the volume
        if isinstance(exc, PrewarmError) or not isinstance(exc, Exception):
            raise
        if isinstance(exc, LayoutError):
            raise PrewarmError(f"{model.source}: {exc}") from None
        # network, registry protocol, a broken archive; a blob's redirect URL loses its signature
        first = without_queries(str(exc).splitlines()[0])[:300] if str(exc) else ""
        raise PrewarmError(f"{model.source}: staging failed: {type(exc).__name__}: {first}") from None
    finally:
        shutil.rmtree(blobs, ignore_errors=True)
    marker = {"files": files, "bytes": total, "layers": len(plan)}
    model.promote(marker)
    log.info("promoted %s and wrote %s: %d files from %d layers", model.final, model.marker.name, files, len(plan))
    return {"source": model.source, "revision": model.revision, **marker}


def _expansion_limit(declared: int) -> int:
    return max(declared, 1) * MAX_EXPANSION
