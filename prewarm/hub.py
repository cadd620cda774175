"""Download one revision of a hub repository into the cache, verified, then promote it.

The hubs' own clients give the listing (``huggingface_hub``, honouring ``HF_ENDPOINT``;
``modelscope``, honouring ``MODELSCOPE_ENDPOINT``): the file list is taken from the hub *before* the
download, at one resolved commit. The transfer is this module's own (``fetch_file``, one file at a
time from the hub's file URL), because the clients' transfers are unbounded: they write whatever the
server sends and compare sizes only afterwards, and they wait on a trickle as long as it trickles. Here
no file grows past its listed size and a download below a minimum rate is abandoned
(``prewarm.transfer``), its ``.partial`` removed and the revision's lock released. Every listed file
must then be there with its size and, where the hub gives one, its hash (LFS sha256 or git blob id on
Hugging Face, sha256 on ModelScope); only then is ``.partial`` renamed into place and the marker
written.

Tokens come from the environment (``HF_TOKEN`` / ``MODELSCOPE_API_TOKEN``, projected from the
Secret by the Job), never from arguments; every message this module prints is passed through
``redact`` so a token that a library put into an error text does not reach the Job's log.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import requests
import urllib3.exceptions

from prewarm.layout import LayoutError, LockTimeout, ModelDir, check_regular_tree, safe_relative_path
from prewarm.progress import Progress
from prewarm.transfer import READ_TIMEOUTS, Limits, Oversize, Stall, TransferError, stream_into

log = logging.getLogger("noctaya.prewarm")

TOKEN_ENV = {"hf": "HF_TOKEN", "modelscope": "MODELSCOPE_API_TOKEN"}
SECRET_ENV = "NOCTAYA_CREDENTIALS_SECRET"  # the Secret's name (never its data), for error messages
HASH_CHUNK = 8 << 20


class PrewarmError(Exception):
    """A failure with a message fit for the Job's log and termination message."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None = None
    git_blob: str | None = None  # git blob sha1 (Hugging Face, files not in LFS)


@dataclass(frozen=True)
class Listing:
    resolved: str | None  # the commit the revision pointed at, when the hub says
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class HubClient:
    """One hub's listing (through its official client) and where each listed file is fetched from."""

    scheme: str

    def listing(self, repo_id: str, revision: str) -> Listing:
        raise NotImplementedError

    def file_request(self, repo_id: str, revision: str, path: str) -> tuple[str, dict[str, str]]:
        """The URL and headers (the token's, when there is one) that fetch ``path`` at ``revision``."""
        raise NotImplementedError

    def download(self, repo_id: str, revision: str, target: Path, listing: Listing, limits: Limits) -> None:
        """Every listed file into ``target``, each bounded by its listed size and the rate ``limits``."""
        with requests.Session() as session:
            for remote in listing.files:
                url, headers = self.file_request(repo_id, revision, remote.path)
                fetch_file(session, url, headers, target / remote.path, remote, limits)

    def auth_failure(self, exc: BaseException) -> str | None:
        """'refused' / 'missing' when ``exc`` is the hub refusing access, else None."""
        raise NotImplementedError


class HuggingFaceClient(HubClient):
    scheme = "hf"

    def listing(self, repo_id: str, revision: str) -> Listing:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        api = HfApi()
        commit = api.repo_info(repo_id, revision=revision).sha
        files = []
        for entry in api.list_repo_tree(repo_id, recursive=True, revision=commit or revision):
            if isinstance(entry, RepoFile):
                lfs = entry.lfs
                files.append(RemoteFile(entry.path, int(entry.size), lfs.sha256 if lfs else None,
                                        None if lfs else entry.blob_id))
        return Listing(commit, tuple(files))

    def file_request(self, repo_id: str, revision: str, path: str) -> tuple[str, dict[str, str]]:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        return hf_hub_url(repo_id, path, revision=revision), build_hf_headers()  # HF_ENDPOINT, HF_TOKEN

    def auth_failure(self, exc: BaseException) -> str | None:
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

        if isinstance(exc, GatedRepoError | RepositoryNotFoundError):
            return "refused"
        if isinstance(exc, HfHubHTTPError | requests.HTTPError) and exc.response is not None \
                and exc.response.status_code in (401, 403):
            return "refused"
        return None


class ModelScopeClient(HubClient):
    scheme = "modelscope"

    def listing(self, repo_id: str, revision: str) -> Listing:
        from modelscope.hub.api import HubApi

        entries = HubApi().list_repo_files(repo_id, "model", revision=revision, recursive=True)
        files = tuple(RemoteFile(e.path, int(e.size), e.sha256) for e in entries
                      if getattr(e, "type", "blob") != "tree" and e.path)
        return Listing(None, files)

    def file_request(self, repo_id: str, revision: str, path: str) -> tuple[str, dict[str, str]]:
        from modelscope.hub.file_download import get_file_download_url
        from modelscope_hub.config import get_default_config

        headers = {}
        token = os.environ.get(TOKEN_ENV[self.scheme])
        if token:  # as modelscope's own client: newer endpoints read the header, older ones the cookie
            headers = {"Authorization": f"Bearer {token}", "Cookie": f"m_session_id={token}"}
        # The endpoint the listing used (MODELSCOPE_ENDPOINT, else the default hub).
        return get_file_download_url(repo_id, path, revision, get_default_config().endpoint), headers

    def auth_failure(self, exc: BaseException) -> str | None:
        from modelscope_hub.errors import AuthenticationError, PermissionDeniedError

        if isinstance(exc, AuthenticationError | PermissionDeniedError):
            return "refused"
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return "refused" if status in (401, 403) else None


NETWORK_ATTEMPTS = 3  # per file: a dropped connection resumes where it stopped; the Job's retries come on top
# A connection lost mid-file (reset, closed before the announced length): retried here, resuming. A
# stall or an oversize body is not: the attempt ends at once so the revision's lock is freed, and the
# Job's own retry (exit status 1) starts over.
DROPPED = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError)


class Incomplete(TransferError):
    """The body ended before the declared size (retried, resuming)."""


def fetch_file(session: requests.Session, url: str, headers: dict[str, str], dest: Path, remote: RemoteFile,
               limits: Limits) -> None:
    """``remote`` from ``url`` into ``dest``: never past its listed size, abandoned when it stalls
    (``prewarm.transfer``); a dropped connection is resumed with a Range request a few times."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for attempt in range(1, NETWORK_ATTEMPTS + 1):
            try:
                _fetch_once(session, url, headers, out, remote, limits)
                return
            except (*DROPPED, Incomplete) as exc:
                if attempt == NETWORK_ATTEMPTS:
                    raise
                log.info("%s: connection lost (%s) at %d of %d bytes, attempt %d of %d; resuming", remote.path,
                         type(exc).__name__, out.tell(), remote.size, attempt, NETWORK_ATTEMPTS)
                time.sleep(attempt)


def _fetch_once(session: requests.Session, url: str, headers: dict[str, str], out: BinaryIO, remote: RemoteFile,
                limits: Limits) -> None:
    have = out.tell()
    # identity: the listed size is the file's, so the body's length is comparable with it.
    sent = {**headers, "Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    try:
        with session.get(url, headers=sent, stream=True, timeout=limits.timeout) as response:
            response.raise_for_status()
            if have and response.status_code != 206:
                out.seek(0)  # the server ignored the range: the whole file again
                out.truncate()
                have = 0
            elif have and not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                raise TransferError(f"{remote.path}: the server answered a resumed download with other bytes "
                                    f"({response.headers.get('Content-Range')!r})")
            size = stream_into(response, out, remote.size, limits, remote.path, have)
    except READ_TIMEOUTS as exc:  # waiting for the response's headers
        raise Stall(f"{remote.path}: stalled: no answer for {limits.read_timeout:g} s (--read-timeout)") from exc
    if size < remote.size:
        raise Incomplete(f"{remote.path}: the body ended at {size} of the {remote.size} bytes listed")


CLIENTS: dict[str, Callable[[], HubClient]] = {"hf": HuggingFaceClient, "modelscope": ModelScopeClient}


def redact(text: str, secrets: Iterable[str | None]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _token() -> list[str | None]:
    return [os.environ.get(v) for v in TOKEN_ENV.values()]


def _auth_message(model: ModelDir, exc: BaseException) -> str:
    secret = os.environ.get(SECRET_ENV, "").strip()
    status = getattr(getattr(exc, "response", None), "status_code", None)
    said = f"HTTP {status}" if status else type(exc).__name__
    if os.environ.get(TOKEN_ENV[model.scheme]):
        named = f'Secret "{secret}"' if secret else TOKEN_ENV[model.scheme]
        return (f"{model.source}@{model.revision}: the hub refused the token from {named} ({said}); "
                "check that the token is valid and has access to the repository")
    return (f"{model.source}@{model.revision}: the hub refused access ({said}) and no token was given; "
            "a private or gated repository needs model.credentialsSecret")


def verify(target: Path, listing: Listing) -> None:
    """Every listed file is there with its size and hash; raises PrewarmError naming the first that is not."""
    for remote in listing.files:
        path = target / remote.path
        try:
            size = path.stat().st_size
        except OSError:
            raise PrewarmError(f"{remote.path}: listed by the hub but not downloaded") from None
        if size != remote.size:
            raise PrewarmError(f"{remote.path}: {size} bytes on disk, the hub lists {remote.size}")
        if remote.sha256 is not None:
            got = file_digest(path, hashlib.sha256())
            if got != remote.sha256.lower():
                raise PrewarmError(f"{remote.path}: sha256 {got} does not match the hub's {remote.sha256}")
        elif remote.git_blob is not None:
            got = file_digest(path, hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False))
            if got != remote.git_blob.lower():
                raise PrewarmError(f"{remote.path}: git blob id {got} does not match the hub's {remote.git_blob}")


def file_digest(path: Path, h: hashlib._Hash) -> str:
    """Hex digest of a file's content, read in bounded chunks."""
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


LOCK_TIMEOUT = 6 * 3600  # the Job's own deadline: waiting longer cannot help


@contextlib.contextmanager
def staging_lock(model: ModelDir, lock_timeout: float, progress_interval: float) -> Iterator[None]:
    """``model.locked``, its timeout reported as a PrewarmError."""
    try:
        with model.locked(lock_timeout, log, progress_interval):
            yield
    except LockTimeout as exc:
        raise PrewarmError(f"{model.source}@{model.revision}: {exc}") from None


def prewarm(model: ModelDir, client: HubClient | None = None, progress_interval: float = 10.0,
            lock_timeout: float = LOCK_TIMEOUT, limits: Limits | None = None) -> dict[str, object]:
    """Stage ``model`` in the cache; returns the marker. Idempotent: a present marker is success.
    One process at a time per revision and cache (``ModelDir.locked``); a failure, a stall included,
    leaves the lock (``with``), so the next attempt can take it."""
    with staging_lock(model, lock_timeout, progress_interval):
        return _prewarm(model, client, progress_interval, limits or Limits())


def _prewarm(model: ModelDir, client: HubClient | None, progress_interval: float,
             limits: Limits) -> dict[str, object]:
    existing = model.read_marker()
    if existing is not None:
        log.info("%s@%s is already in the cache (%s files); nothing to do", model.source, model.revision,
                 existing.get("files"))
        return existing
    client = client or CLIENTS[model.scheme]()
    model.parent.mkdir(parents=True, exist_ok=True)
    if model.clear_partial():
        log.info("removed %s left by an interrupted attempt", model.partial.name)
    try:
        listing = client.listing(model.repo_id, model.revision)
    except Exception as exc:
        raise _failure(model, client, exc, "listing the repository") from None
    if not listing.files:
        raise PrewarmError(f"{model.source}@{model.revision}: the hub lists no files")
    try:
        for remote in listing.files:  # a listing is input from the network: it names files inside the target only
            safe_relative_path(remote.path, "listed file")
    except LayoutError as exc:
        raise PrewarmError(f"{model.source}@{model.revision}: {exc}") from None
    pinned = listing.resolved or model.revision
    log.info("downloading %s@%s%s: %d files, %s", model.source, model.revision,
             f" (commit {listing.resolved})" if listing.resolved and listing.resolved != model.revision else "",
             len(listing.files), Progress.human(listing.total_bytes))
    model.partial.mkdir(parents=True)
    with Progress(model.partial, listing.total_bytes, log, progress_interval):
        try:
            client.download(model.repo_id, pinned, model.partial, listing, limits)
        except (Oversize, Stall) as exc:
            shutil.rmtree(model.partial, ignore_errors=True)  # refused or abandoned: its bytes leave the volume now
            raise PrewarmError(redact(f"{model.source}@{model.revision}: {exc}", _token())) from None
        except Exception as exc:
            raise _failure(model, client, exc, "downloading") from None
    verify(model.partial, listing)
    try:
        check_regular_tree(model.partial)  # what the client wrote: regular files and directories only
    except LayoutError as exc:
        raise PrewarmError(f"{model.source}@{model.revision}: {exc}") from None
    marker = {"resolved": listing.resolved, "files": len(listing.files), "bytes": listing.total_bytes}
    model.promote(marker)
    log.info("promoted %s and wrote %s: %d files, %s", model.final, model.marker.name, len(listing.files),
             Progress.human(listing.total_bytes))
    return {"source": model.source, "revision": model.revision, **marker}


def _failure(model: ModelDir, client: HubClient, exc: BaseException, doing: str) -> PrewarmError:
    if client.auth_failure(exc) is not None:
        return PrewarmError(_auth_message(model, exc))
    status = getattr(getattr(exc, "response", None), "status_code", None)
    first = without_queries(str(exc).splitlines()[0])[:300] if str(exc) else ""
    detail = f"HTTP {status}" if status else f"{type(exc).__name__}: {first}"
    return PrewarmError(redact(f"{model.source}@{model.revision}: {doing} failed: {detail}", _token()))


def without_queries(text: str) -> str:
    """A URL's query string cut from an error text: a hub's redirect to its CDN carries a signature
    there, a short-lived credential that does not belong in the Job's log."""
    return re.sub(r"\?[^\s'\")]+", "?…", text)
