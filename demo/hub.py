"""A STAND-IN for a model hub on 127.0.0.1, for the prewarm demo and the downloader's tests. It speaks
the part of the Hugging Face HTTP protocol that `huggingface_hub` uses to download a snapshot (repo
info, recursive tree, resolve with HEAD + GET and Range) and the part of ModelScope's API that
`modelscope` uses (file list, file download), with the faults a downloader must survive: a
connection dropped mid-file, a wrong token, bytes that do not match the listing; and an optional
bandwidth limit so a download takes long enough to watch.

Repos hold revisions (branch/tag names -> commit), commits hold files. Git blob ids and LFS sha256
are computed like the hub does, so a client that checks them checks real values."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_THRESHOLD = 1024  # files at least this big are "LFS" files (sha256 known to the hub)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> path -> content
    refs: dict[str, str]  # branch or tag -> commit sha
    token: str | None = None  # when set, every request needs "Bearer <token>"


@dataclass
class FakeHub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)  # path -> how many more GETs are cut off halfway
    requests: list[str] = field(default_factory=list)
    tamper: dict[str, bytes] = field(default_factory=dict)  # path -> bytes served instead of the listed ones
    bytes_per_second: float | None = None  # a slow link, for the demo
    host: str = "127.0.0.1"  # another loopback address: a hub that is not on the Pod's own localhost

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._server.server_port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- protocol ---------------------------------------------------------------------------------

    def _commit(self, repo: HubRepo, revision: str) -> str | None:
        if revision in repo.commits:
            return revision
        return repo.refs.get(revision)

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        self.requests.append(f"{h.command} {h.path}")
        segments = path.strip("/").split("/")
        if segments[:3] == ["api", "v1", "models"] and len(segments) >= 5:
            return self._modelscope(h, "/".join(segments[3:5]), segments[5:], parse_qs(parts.query), head)
        if segments[:2] == ["api", "models"] and len(segments) >= 6:
            repo_id = "/".join(segments[2:4])
            kind, revision = segments[4], segments[5]
            return self._api(h, repo_id, kind, revision, parse_qs(parts.query))
        if len(segments) >= 5 and segments[2] == "resolve":
            repo_id = "/".join(segments[:2])
            return self._resolve(h, repo_id, segments[3], "/".join(segments[4:]), head)
        return self._json(h, 404, {"error": "not found"})

    def _authorized(self, h: BaseHTTPRequestHandler, repo: HubRepo) -> bool:
        if repo.token is None or h.headers.get("Authorization") == f"Bearer {repo.token}":
            return True
        # The hub's answer to a bad token on a private repo.
        self._json(h, 401, {"error": "Invalid credentials in Authorization header"},
                   {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid credentials in Authorization header"})
        return False

    def _api(self, h: BaseHTTPRequestHandler, repo_id: str, kind: str, revision: str, query: dict) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._json(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        if not self._authorized(h, repo):
            return None
        commit = self._commit(repo, revision)
        if commit is None:
            return self._json(h, 404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"})
        files = repo.commits[commit]
        if kind == "revision":
            return self._json(h, 200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.token is not None,
                                       "siblings": [{"rfilename": p} for p in sorted(files)]})
        if kind == "tree":
            entries = []
            for p in sorted(files):
                data = files[p]
                entry = {"type": "file", "path": p, "size": len(data), "oid": git_blob_id(data)}
                if len(data) >= LFS_THRESHOLD:
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            return self._json(h, 200, entries)
        return self._json(h, 404, {"error": "not found"})

    def _resolve(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, filename: str, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._json(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        if not self._authorized(h, repo):
            return None
        commit = self._commit(repo, revision)
        if commit is None or filename not in repo.commits[commit]:
            return self._json(h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        data = repo.commits[commit][filename]
        etag = hashlib.sha256(data).hexdigest() if len(data) >= LFS_THRESHOLD else git_blob_id(data)
        return self._send_file(h, data, filename, commit, etag, head)

    def _send_file(self, h: BaseHTTPRequestHandler, data: bytes, filename: str, commit: str, etag: str,
                   head: bool) -> None:
        data = self.tamper.get(filename, data)
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[6:].split("-")[0] or 0)
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return None
        if self.drops.get(filename, 0) > 0 and len(body) > 1:
            self.drops[filename] -= 1
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the server goes away mid-file
            return None
        if self.bytes_per_second:
            step = 64 * 1024
            for i in range(0, len(body), step):
                h.wfile.write(body[i:i + step])
                time.sleep(len(body[i:i + step]) / self.bytes_per_second)
            return None
        h.wfile.write(body)
        return None

    # -- ModelScope's API (MODELSCOPE_ENDPOINT) ---------------------------------------------------

    def _modelscope(self, h: BaseHTTPRequestHandler, repo_id: str, rest: list[str], query: dict, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._json(h, 404, {"Code": 10010205001, "Message": "model not found", "Success": False})
        cookie = h.headers.get("Cookie") or ""
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}" \
                and f"m_session_id={repo.token}" not in cookie:
            return self._json(h, 401, {"Code": 10010101001, "Message": "Unauthorized", "Success": False})
        revision = (query.get("Revision") or ["master"])[0]
        commit = self._commit(repo, revision)
        if commit is None:
            return self._json(h, 404, {"Code": 10010205002, "Message": f"revision {revision} not found", "Success": False})
        files = repo.commits[commit]
        if rest == ["repo", "files"]:
            entries = [{"Path": p, "Name": p.rsplit("/", 1)[-1], "Type": "blob", "Size": len(files[p]),
                        "Sha256": hashlib.sha256(files[p]).hexdigest(), "Revision": commit} for p in sorted(files)]
            return self._json(h, 200, {"Code": 200, "Data": {"Files": entries}, "Success": True})
        if rest == ["repo"]:
            filename = (query.get("FilePath") or [""])[0]
            if filename not in files:
                return self._json(h, 404, {"Code": 10010205003, "Message": "file not found", "Success": False})
            return self._send_file(h, files[filename], filename, commit, hashlib.sha256(files[filename]).hexdigest(), head)
        if not rest:
            return self._json(h, 200, {"Code": 200, "Data": {"Id": repo_id, "Revision": commit}, "Success": True})
        if rest == ["revisions"]:
            tags = [{"Revision": name, "CommitId": sha} for name, sha in repo.refs.items()]
            return self._json(h, 200, {"Code": 200, "Data": {"RevisionMap": {"Tags": tags, "Branches": []}}, "Success": True})
        return self._json(h, 404, {"Code": 404, "Message": "not found", "Success": False})

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, code: int, payload: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
